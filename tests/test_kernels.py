"""Compiled kernels (nemo_dcr.kernels): bit-exact against the reference paths, the same
bits with and without numba, round trips of the rANS encodings, and clean
rejection of damaged sections."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_dcr import kernels
from nemo_dcr.diff import _diff_compiled, _diff_cpu_words, diff, diff_arrays
from nemo_dcr.errors import PayloadRejected
from nemo_dcr.placement import AffineMap, Piece
from nemo_dcr.records import Op, Payload, PayloadHeader, Record
from nemo_dcr.wire import codec, joint
from nemo_dcr.wire.errors import PositionsError
from nemo_dcr.wire.frame import CHECKSUM_BYTES
from nemo_dcr.wire.gaps import decode_gaps_rans, encode_gaps_rans, gaps_parts
from nemo_dcr.wire.rans import RansStream, decode_rans, decode_rans_pair, encode_rans, encode_rans_pair, quantize
from nemo_dcr.wire.values import (
    _zeroed_tables,
    choose_op,
    choose_op_from_add,
    encode_value_symbols,
    value_histogram,
    value_parts,
)
from nemo_dcr.wire.varints import Reader, leb128_encode

HDR = PayloadHeader("t", 0, 1, "p", "p-0")
NP_DTYPES = [np.int16, np.int32, np.uint8, np.int8]

needs_numba = pytest.mark.skipif(not kernels.common.HAVE_NUMBA, reason="numba not installed")


# -------------------------------------------------------------- diff


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(NP_DTYPES), st.integers(0, 3000), st.sampled_from([0.0, 0.001, 0.03, 0.3, 1.0]),
       st.integers(0, 7), st.integers(0, 2**32 - 1))
def test_compiled_diff_matches_reference(dtype, n, rate, offset, seed):
    """Same (positions, new, old) as numpy's elementwise compare, for any size, rate and
    (non-word-aligned) offset, and as the numpy word path."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 100, n + offset).astype(dtype)
    new = old.copy()
    hit = rng.random(n + offset) < rate
    new[hit] = (new[hit] + 1).astype(dtype)
    a, b = new[offset:], old[offset:]
    ref = np.flatnonzero(a != b)
    for impl in (_diff_compiled, _diff_cpu_words):
        pos, nv, ov = impl(a, b)
        np.testing.assert_array_equal(pos, ref)
        assert pos.dtype == np.int64 and nv.dtype == a.dtype and ov.dtype == a.dtype
        np.testing.assert_array_equal(nv, a[ref])
        np.testing.assert_array_equal(ov, b[ref])
    if n >= 64:  # the public entry point, on torch views of the slices
        d = diff(torch.from_numpy(a), torch.from_numpy(b))
        np.testing.assert_array_equal(d.positions.numpy(), ref)


def test_compiled_diff_grows_its_buffers():
    """All changed (more than the first buffer holds) and none changed."""
    a = np.arange(100_000, dtype=np.int16)
    b = a + np.int16(1)
    pos, nv, ov = _diff_compiled(a, b)
    np.testing.assert_array_equal(pos, np.arange(a.size))
    np.testing.assert_array_equal(nv, a)
    np.testing.assert_array_equal(ov, b)
    pos, _, _ = _diff_compiled(a, a.copy())
    assert pos.size == 0


def test_diff_words_resumes_where_the_buffer_was_full():
    a = np.zeros(4096, np.int16)
    b = a.copy()
    b[::3] = 1
    aw, bw = a.view(np.int64), b.view(np.int64)
    small = [np.empty(100, np.int64), np.empty(100, np.int16), np.empty(100, np.int16)]
    n, w = kernels.diff.diff_words(a, b, aw, bw, 4, 0, *small, 0)
    assert w < aw.size and n <= 100
    big = [np.empty(4096, np.int64), np.empty(4096, np.int16), np.empty(4096, np.int16)]
    for x, y in zip(big, small):
        x[:n] = y[:n]
    n, w = kernels.diff.diff_words(a, b, aw, bw, 4, w, *big, n)
    assert w == aw.size
    np.testing.assert_array_equal(big[0][:n], np.flatnonzero(a != b))


@needs_numba
@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize("values", [(), ("old",), ("xor",), ("add",)])
@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.uint8])
def test_diff_arrays_values_match_numpy(monkeypatch, vector, values, dtype):
    """The producer's one-pass diff: positions (+ base), new bits and each value array the
    records carry, on the 16-bit scans (512-bit compresses; bit scans where the host has
    no AVX-512, or `vector` is off) and on the word scan (other widths), against numpy;
    sizes that end mid-block, buffers that must grow, and changes that wrap around."""
    if vector and not kernels.diff.HAVE_VECTOR_DIFF:
        pytest.skip("host has no AVX-512 VBMI2")
    monkeypatch.setattr(kernels.diff, "HAVE_VECTOR_DIFF", vector)
    rng = np.random.default_rng(len(values) * 7 + np.dtype(dtype).itemsize)
    info = np.iinfo(dtype)
    for n, rate in [(0, 0.0), (127, 0.5), (128 * 40 + 77, 0.01), (50_000, 0.9), (9_000, 0.0)]:
        old = rng.integers(info.min, info.max, n, endpoint=True).astype(dtype)
        new = old.copy()
        hit = rng.random(n) < rate
        new[hit] = rng.integers(info.min, info.max, int(hit.sum()), endpoint=True).astype(dtype)
        ref = np.flatnonzero(new != old)
        pos, nv, vals = diff_arrays(new, old, values, base=1000)
        np.testing.assert_array_equal(pos, ref + 1000)
        assert pos.dtype == np.int64 and nv.dtype == new.dtype
        # narrow: int32 positions from the 16-bit scan while base + size < 2**31; the rest alike
        for base in (1000, (1 << 31) - n, (1 << 31) - n + 1):
            npos, nnv, nvals = diff_arrays(new, old, values, base=base, narrow=True)
            narrow = dtype == np.int16 and base + n < (1 << 31)
            assert npos.dtype == (np.int32 if narrow else np.int64)
            np.testing.assert_array_equal(npos.astype(np.int64), ref + base)
            for x, y in zip([nnv, *nvals], [nv, *vals]):
                np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(nv, new[ref])
        want = {"old": old[ref], "xor": new[ref] ^ old[ref], "add": new[ref] - old[ref]}
        assert len(vals) == len(values)
        for kind, got in zip(values, vals):
            assert got.dtype == new.dtype
            np.testing.assert_array_equal(got, want[kind], err_msg=f"{kind}, n={n}")


@pytest.mark.parametrize("mode", [kernels.diff.DIFF_OLD, kernels.diff.DIFF_XOR, kernels.diff.DIFF_ADD,
                                  kernels.diff.DIFF_NONE])
def test_bitscan_walks_any_count_of_changes_in_a_word(mode):
    """`diff16_bitscan` walks a 64-element word's changes two a step: every count from 0 to
    64 in the first word of a block beside 0, 1, 2 or 3 in the second, at random places,
    gives numpy's positions, new bits and values, no slot is written more than two past
    the last change, and the compiled scan fills every slot as the plain-Python one does."""
    rng = np.random.default_rng(mode)
    blocks = [(first, second) for first in range(65) for second in range(4)]
    old = rng.integers(0, 1 << 16, 128 * len(blocks), dtype=np.uint16)
    new = old.copy()
    for k, (first, second) in enumerate(blocks):
        for word, count in ((0, first), (1, second)):
            at = 128 * k + 64 * word + rng.choice(64, count, replace=False)
            new[at] += rng.integers(1, 1 << 16, count, dtype=np.uint16)  # never 0: each one changes
    want = np.flatnonzero(new != old)
    with np.errstate(over="ignore"):
        expected = {kernels.diff.DIFF_OLD: old[want], kernels.diff.DIFF_XOR: new[want] ^ old[want],
                    kernels.diff.DIFF_ADD: new[want] - old[want]}.get(mode)
    room = want.size + kernels.diff.DIFF_BLOCK + 8
    filled = []
    compiled = [kernels.diff.diff16_bitscan] if kernels.common.HAVE_NUMBA else []
    for scan in [kernels.diff.diff16_bitscan.py_func] + compiled:
        bufs = [np.full(room, 7777, np.int64), np.full(room, 7777, np.uint16),
                np.full(room if mode != kernels.diff.DIFF_NONE else 0, 7777, np.uint16)]
        with np.errstate(over="ignore"):  # the plain-Python twin's wrapping add
            n, i = scan(new, old, 0, 5, *bufs, mode, 0, *kernels.diff.NO_ROWS)
        assert (n, i) == (want.size, new.size)
        np.testing.assert_array_equal(bufs[0][:n], want + 5)
        np.testing.assert_array_equal(bufs[1][:n], new[want])
        if expected is not None:
            np.testing.assert_array_equal(bufs[2][:n], expected)
        assert all((x[n + 2:] == 7777).all() for x in bufs)
        filled.append(bufs)
    if len(filled) == 2:  # compiled and plain Python: every slot alike, past the changes too
        for x, y in zip(*filled):
            np.testing.assert_array_equal(x, y)


@needs_numba
@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize("values", [(), ("old",), ("xor",), ("add",)])
def test_diff_arrays_writes_chunks_end_to_end(monkeypatch, vector, values):
    """With a DiffOutput, the chunks of a range come out as the chunk-by-chunk diff would
    give them, each view directly after the one before in the same buffers, but where a
    chunk did not fit: it moved to new buffers, and the views handed out before kept
    their contents. Chunk sizes with tails, a chunk without changes, and rates that
    outgrow the first buffers (sized for ~1 change in 16). Both 16-bit scans."""
    from nemo_dcr.diff import DiffOutput

    if vector and not kernels.diff.HAVE_VECTOR_DIFF:
        pytest.skip("host has no AVX-512 VBMI2")
    monkeypatch.setattr(kernels.diff, "HAVE_VECTOR_DIFF", vector)

    rng = np.random.default_rng(len(values))
    sizes = [128 * 50, 128 * 50 + 77, 3000, 128 * 64, 128 * 200, 500, 128 * 30]
    rates = [0.02, 0.01, 0.0, 0.05, 0.9, 0.5, 0.03]
    old = rng.integers(-(1 << 15), 1 << 15, sum(sizes)).astype(np.int16)
    new = old.copy()
    at = 0
    for size, rate in zip(sizes, rates):
        hit = np.flatnonzero(rng.random(size) < rate) + at
        new[hit] += rng.integers(1, 200, hit.size).astype(np.int16)
        at += size
    sink = DiffOutput(old.size)
    got, moved, at = [], 0, 0
    for size in sizes:
        lo, hi = at, at + size
        arrays = diff_arrays(new[lo:hi], old[lo:hi], values, base=lo, narrow=True, out=sink)
        want = diff_arrays(new[lo:hi], old[lo:hi], values, base=lo, narrow=True)
        flat = [arrays[0], arrays[1], *arrays[2]]
        for x, y in zip(flat, [want[0], want[1], *want[2]]):
            np.testing.assert_array_equal(x, y)
        if got and got[-1][0].size:
            follows = [x.ctypes.data == p.ctypes.data + p.nbytes for x, p in zip(flat, got[-1])]
            assert all(follows) or not any(follows)
            moved += not follows[0]
        got.append(flat)
        at = hi
    assert moved >= 1  # the 90% chunk outgrew the buffers sized for the range at 1/16
    for (lo, size), arrays in zip(zip(np.cumsum([0] + sizes[:-1]), sizes), got):
        ref = np.flatnonzero(new[lo:lo + size] != old[lo:lo + size])
        np.testing.assert_array_equal(arrays[0], ref + lo)  # still intact after later chunks
        np.testing.assert_array_equal(arrays[1], new[lo:lo + size][ref])


@pytest.mark.parametrize("n", [20_000, 20_001])
def test_rans_pair_gives_the_two_single_streams(n):
    """encode_rans_pair codes both streams in one pass: the same bytes as two encode_rans,
    with and without the symbol lookup table, and when one stream has a single symbol;
    for an even and an odd count (the coders take symbols two at a time)."""
    rng = np.random.default_rng(5)
    s1 = rng.geometric(0.2, n).clip(max=200).astype(np.int32) - 1
    raw2 = rng.integers(0, 1 << 16, n).astype(np.uint16) % 37
    lut = np.full(1 << 16, 0, np.int16)
    lut[:37] = np.arange(37)[::-1]
    mapped = lut[raw2].astype(np.int32)
    c1, c2 = np.bincount(s1), np.bincount(mapped, minlength=37)

    def pair(*args):  # the two streams' chunks, joined
        return tuple(b"".join(chunks) for chunks in encode_rans_pair(*args))

    assert pair(s1, c1, raw2, c2, lut) == (encode_rans(s1, c1), encode_rans(mapped, c2))
    assert pair(s1, c1, mapped, c2) == (encode_rans(s1, c1), encode_rans(mapped, c2))
    one = np.zeros(n, np.int32)
    assert pair(s1, c1, one, np.array([n])) == (encode_rans(s1, c1), encode_rans(one, np.array([n])))


def _stream(sym, dtype):
    return RansStream.read(Reader(encode_rans(sym, np.bincount(sym))), 1024, "t", dtype)


def test_rans_pair_decode_gives_the_two_single_decodes():
    """kernels.rans.rans_decode2 (compiled and as Python): the symbols and statuses of two
    rans_decode calls, on intact streams and on damaged ones (flipped or missing words,
    the wrong symbol count), whichever stream fails; decode_rans_pair raises the same
    errors as the single decodes."""
    rng = np.random.default_rng(9)
    n = 5000
    s1 = (rng.geometric(0.2, n).clip(max=200) - 1).astype(np.int32)
    s2 = (rng.random(n) < 0.3).astype(np.int32)
    a, b = _stream(s1, np.uint8), _stream(s2, np.int16)
    sa, st_a, sb, st_b = decode_rans_pair(a, b, n)
    assert (st_a, st_b) == (0, 0)
    np.testing.assert_array_equal(sa, s1)
    np.testing.assert_array_equal(sb, s2)

    def single(stream, words, m):
        out = np.zeros(m, stream.dtype)
        return kernels.rans.rans_decode(words, stream.freq, stream.cum, stream.slot2sym, out), out

    statuses = set()
    for i in range(300):
        wa, wb, m = a.words.copy(), b.words.copy(), n + int(rng.integers(-2, 3)) * (i % 5 == 0)
        for w in ((wa,), (wb,), (wa, wb))[i % 3]:
            if i % 7 == 6:
                w = w[:int(rng.integers(0, w.size))]  # truncated
                wa, wb = (w, wb) if i % 3 == 0 else (wa, w)
            else:
                for _ in range(int(rng.integers(1, 3))):
                    w[int(rng.integers(0, w.size))] ^= np.uint16(1 << int(rng.integers(0, 16)))
        want = [single(a, wa, m), single(b, wb, m)]
        for fn in (kernels.rans.rans_decode2, kernels.rans.rans_decode2.py_func):
            oa, ob = np.zeros(m, np.uint8), np.zeros(m, np.int16)
            got = fn(wa, a.freq, a.cum, a.slot2sym, oa, wb, b.freq, b.cum, b.slot2sym, ob)
            assert tuple(int(x) for x in got) == (want[0][0], want[1][0])
            for (_, ref), out in zip(want, (oa, ob)):  # up to a failure, the same symbols too
                np.testing.assert_array_equal(out, ref)
        statuses.update((want[0][0], want[1][0]))
        for stream, words, status in ((a, wa, want[0][0]), (b, wb, want[1][0])):
            if status:
                with pytest.raises(PositionsError) as single_err:
                    stream.check(status)
                stream.words = words
                with pytest.raises(PositionsError) as err:
                    stream.decode(m)
                assert str(err.value) == str(single_err.value)
        a.words, b.words = _stream(s1, np.uint8).words, _stream(s2, np.int16).words
    assert {0, -1, -2, -3} <= statuses


def _random_damage(seed: int):
    """A damage for `_resealed`: seed % 4 == 3 truncates the section, the others flip 1-3 bits."""
    def damage(b):
        r = np.random.default_rng(seed)
        if seed % 4 == 3:
            return b[:int(r.integers(0, len(b)))]
        for _ in range(int(r.integers(1, 4))):
            b[int(r.integers(0, len(b)))] ^= 1 << int(r.integers(0, 8))
        return b
    return damage


@pytest.mark.parametrize("part", ["positions", "values"])
def test_paired_record_decode_rejects_like_the_single_decodes(monkeypatch, part):
    """A record decoded with its two rANS streams in one pass is rejected with the same
    reason as one decoded stream by stream."""
    rng = np.random.default_rng(4)
    pos = np.flatnonzero(rng.random(200_000) < 0.03).astype(np.uint64)
    vals = np.where(rng.random(pos.size) < 0.5, 1, 0xFFFF).astype(np.uint16)
    monkeypatch.setattr(codec, "encode_joint", lambda *args: None)  # two streams, not one joint stream
    data = codec.encode(Payload(HDR, [Record("w", "BF16", (200_000,), Op.ADD, pos, vals)]))
    assert pos.size >= codec._PAIR_MIN and b"symbols_rans" in data and b"gaps_rans" in data
    out = codec.decode(data).records[0]
    np.testing.assert_array_equal(out.positions, pos)
    np.testing.assert_array_equal(out.values, vals)
    reasons = []
    for i in range(60):
        bad = _resealed(data, part, _random_damage(i))
        got = []
        for pair_min in (codec._PAIR_MIN, 1 << 62):
            monkeypatch.setattr(codec, "_PAIR_MIN", pair_min)
            try:
                codec.decode(bad)
                got.append(None)
            except PayloadRejected as e:
                got.append(e.reason)
        assert got[0] == got[1]
        reasons.append(got[0])
    assert sum(r is not None for r in reasons) > 30


# -------------------------------------------------------------- placement


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 50), st.integers(1, 50), st.sampled_from([0, 0, 1, 1000]), st.integers(0, 100),
       st.integers(0, 10**6), st.booleans(), st.integers(0, 100), st.integers(0, 2**32 - 1))
def test_affine_kernel_matches_divmod(rows, cols, extra_stride, start, offset, shuffle, shift, seed):
    """Strided pieces (the compiled kernel) and contiguous ones (a constant shift), with
    the local positions given relative to `shift`."""
    p = Piece("c", start, rows, cols, offset, cols + extra_stride)
    rng = np.random.default_rng(seed)
    local = np.sort(rng.choice(p.size, size=min(p.size, 40), replace=False)).astype(np.int64) + start
    if shuffle:
        rng.shuffle(local)
    rel = local - start
    r, c = np.divmod(rel, cols)
    want = offset + r * p.row_stride + c
    np.testing.assert_array_equal(p.canonical_index(local - shift, shift), want)
    local32 = (local - shift).astype(np.int32)  # the producer's diff gives int32 positions
    narrow = p.canonical_index(local32, shift)
    assert narrow.dtype == (np.int32 if p.canonical_stop < 2**31 else np.int64)
    np.testing.assert_array_equal(narrow, want)
    far = Piece("c", start, rows, cols, offset + 2**31, cols + extra_stride)  # indices past int32: int64
    assert far.canonical_index(local32, shift).dtype == np.int64
    np.testing.assert_array_equal(far.canonical_index(local32, shift), want + 2**31)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 6), st.integers(1, 9)), min_size=1, max_size=6),
       st.integers(0, 3), st.integers(0, 2**32 - 1))
def test_place_spans_of_int32_positions_match_int64(shapes, shift, seed):
    """The producer's diff hands placement int32 positions (relative to its owned range):
    the same spans, canonical positions and order flags as int64 positions, through pieces
    with gaps between them and a shift; a piece past an int32 key clips, not wraps."""
    pieces, at = [], 0
    for gap, rows, cols in shapes:
        pieces.append(Piece(f"c{len(pieces)}", at + gap, rows, cols, 5 * len(pieces), cols + (len(pieces) % 2)))
        at += gap + rows * cols
    amap = AffineMap("w", at, tuple(pieces))
    rng = np.random.default_rng(seed)
    local = np.sort(rng.choice(at, size=min(at, 30), replace=False)).astype(np.int64) - shift
    local = local[local >= 0]
    local32 = local.astype(np.int32)
    wide, narrow = amap.place_spans(local, shift), amap.place_spans(local32, shift)
    assert [(n, lo, hi, m) for n, _, lo, hi, m in narrow] == [(n, lo, hi, m) for n, _, lo, hi, m in wide]
    for (_, a, lo, hi, _), (_, b, *_) in zip(narrow, wide):
        assert a.dtype == np.int32 and b.dtype == np.int64  # canonical indices below 2**31
        np.testing.assert_array_equal(a, b)
    far = AffineMap("w", (1 << 33) + 10, (Piece("lo", 0, 1, 10, 0, 10), Piece("hi", 1 << 33, 1, 10, 0, 10)))
    assert [n for n, *_ in far.place_spans(np.arange(10, dtype=np.int32))] == ["lo"]


@pytest.mark.parametrize("compiled", [True, False])
def test_affine_kernel_rows_are_exact_far_out(compiled):
    """affine_index finds rows by a double-precision multiply set right by one step: exact
    at row boundaries, for offsets below the start, and past 2**50 (its integer fallback)."""
    fn = kernels.place.affine_index if compiled else kernels.place.affine_index.py_func
    for cols in (1, 3, 4096, 7168, 12345, (1 << 31) - 1):
        near = np.array([0, 1, cols - 1, cols, cols + 1, 5 * cols - 1, 5 * cols, -1, -cols, -cols - 1], np.int64)
        for centre in (0, 1 << 49, (1 << 50) - 7, 1 << 50, 1 << 53):
            local = np.unique(near + centre - centre % cols) + 11
            out = np.empty(local.size, np.int64)
            fn(local, 11, cols, 5, cols + 9, out)
            want = [5 + (v - 11) // cols * (cols + 9) + (v - 11) % cols for v in local.tolist()]
            assert out.tolist() == want, (cols, centre)


@pytest.mark.parametrize("compiled", [True, False])
def test_affine_kernel_multiply_shift_rows_match_integer_division(compiled):
    """Offsets in [0, 2**31) of pieces with row_stride >= cols take a multiply by a 32-bit
    reciprocal and a shift for the row: exact for every width up to 2**31 - 1, at both
    ends of every row and at the top of the range; offsets outside it (below the start,
    2**31 and past) and shrinking strides take the double-precision loop, in the same call."""
    fn = kernels.place.affine_index if compiled else kernels.place.affine_index.py_func
    rng = np.random.default_rng(31)
    top = (1 << 31) - 1
    widths = [1, 2, 3, 7, 4096, 7168, 12345, (1 << 30) + 1, top] + rng.integers(1, top, 6 if compiled else 2).tolist()
    for cols in widths:
        for grow in (0, 1, 9, cols, (1 << 31) - 1 - cols, -1, 1 << 31):
            rows = np.array([0, 1, 2, top // cols - 1, top // cols], np.int64)
            rel = np.concatenate([rows * cols, rows * cols - 1, rows * cols + cols - 1, [top, top - 1, 0]])
            if compiled:
                rel = np.concatenate([rel, rng.integers(0, top, 2000)])
            for extra in ([], [-cols, top], [0, 1 << 31, (1 << 33) + 5]):
                r = np.unique(np.concatenate([rel, extra]).astype(np.int64))
                # all narrow; some below the start; some at 2**31 and past (none below)
                r = r[(r >= min(extra, default=0)) & (r <= max(extra, default=top))]
                local = r + 11
                out = np.empty(local.size, np.int64)
                fn(local, 11, cols, 5, cols + grow, out)
                want = [5 + (v // cols) * (cols + grow) + v % cols for v in r.tolist()]
                if max(map(abs, want)) >= 1 << 62:
                    continue  # past any tensor's flat index (int64 wraps)
                assert out.tolist() == want, (cols, grow, extra)


def test_piece_in_place_maps_without_a_copy():
    """A contiguous piece that sits where the local tensor does (a data-parallel shard of a
    tensor placed as is) hands the positions back as they are; one elsewhere shifts them."""
    local = np.array([3, 4, 9, 30], np.int64)
    assert Piece("c", 0, 4, 8, 0, 8).canonical_index(local) is local
    local32 = local.astype(np.int32)
    assert Piece("c", 0, 4, 8, 0, 8).canonical_index(local32) is local32
    assert Piece("c", 2, 1, 40, 7, 40).canonical_index(local - 5, 5) is not local
    np.testing.assert_array_equal(Piece("c", 2, 1, 40, 7, 40).canonical_index(local - 5, 5), local + 5)
    np.testing.assert_array_equal(Piece("c", 0, 4, 8, 0, 9).canonical_index(local), [3, 4, 10, 33])


@needs_numba
def test_strided_pieces_place_chunk_after_chunk_end_to_end():
    """The producer's slots (placement.PositionSlots): a strided piece's canonical positions of
    successive chunks go end to end into one buffer per piece, the same positions as
    without; a chunk that does not fit, or of another dtype, starts a new buffer and
    leaves the views handed out as they were. Contiguous pieces compute nothing there."""
    from nemo_dcr.diff import DiffOutput
    from nemo_dcr.placement import PositionSlots

    amap = AffineMap("w", 2 * 64 * 50, (Piece("a", 0, 64, 50, 0, 100), Piece("b", 64 * 50, 64, 50, 50, 100)))
    sink = DiffOutput(0)
    sink.bufs = [np.empty(40, np.int32)]  # the diff's room: 40 slots a new buffer
    slots = PositionSlots(sink)
    rng = np.random.default_rng(3)
    local = np.sort(rng.choice(amap.numel, 120, replace=False)).astype(np.int32)
    got, want = {}, {}
    for chunk in np.array_split(local, 6):
        for (name, cpos, *_), (_, ref, *_) in zip(amap.place_spans(chunk, 0, slots), amap.place_spans(chunk)):
            np.testing.assert_array_equal(cpos, ref)
            got.setdefault(name, []).append(cpos)
            want.setdefault(name, []).append(ref.copy())
    for name, views in got.items():
        follows = [b.ctypes.data == a.ctypes.data + a.nbytes for a, b in zip(views, views[1:]) if b.size]
        assert any(follows) and not all(follows)  # end to end, but for a new 40-slot buffer
        for view, ref in zip(views, want[name]):
            np.testing.assert_array_equal(view, ref)  # later chunks wrote elsewhere
    wide = slots.take(0, 3, np.int64)  # another dtype: a buffer of its own
    assert wide.dtype == np.int64 and not np.shares_memory(wide, got["a"][-1])
    flat = AffineMap("f", 100, (Piece("f", 0, 1, 100, 0, 100),))
    ones = np.arange(5, dtype=np.int32)
    used = {k: n for k, (_, n) in slots.bufs.items()}
    assert np.shares_memory(flat.place_spans(ones, 0, slots)[0][1], ones)
    assert {k: n for k, (_, n) in slots.bufs.items()} == used  # no slots taken


# -------------------------------------------------------------- rANS / gaps_rans


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 5000), st.floats(0.0002, 1.0), st.integers(0, 2**32 - 1))
def test_gaps_rans_roundtrip(n, rate, seed):
    rng = np.random.default_rng(seed)
    pos = np.flatnonzero(rng.random(n) < rate).astype(np.uint64)
    if pos.size == 0:
        pos = np.array([n - 1], np.uint64)
    raw, adjacent = encode_gaps_rans(pos)
    assert adjacent == int(np.count_nonzero(np.diff(pos.astype(np.int64)) == 1))
    np.testing.assert_array_equal(decode_gaps_rans(raw, pos.size, n), pos)
    if pos[-1] > 0:
        with pytest.raises(PositionsError):
            decode_gaps_rans(raw, pos.size, int(pos[-1]))  # one short of the last position


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("r", [0, 3, 40])
def test_gaps_split_stops_at_the_first_position_out_of_order(compiled, r):
    split = kernels.gaps.gaps_split if compiled else kernels.gaps.gaps_split.py_func

    def run(p):
        return split(p, r, 255, np.empty(p.size, np.uint8), np.zeros(256, np.int64),
                     np.empty((p.size * r + 7) // 8, np.uint8), np.empty(p.size, np.int64),
                     np.empty(-(-p.size // 8) * 8 if 1 <= r <= 8 else 0, np.uint8))

    pos = np.arange(0, 6003, 3, dtype=np.int64) << (r // 2)
    assert run(pos)[3] == 0
    for i, value in [(1001, pos[1000]),   # equal to the one before
                     (1000, pos[999] - 1),  # below the one before
                     (1002, pos[1001]), (1003, pos[1002]),  # every place in a step of four gaps
                     (pos.size - 1, pos[-2]),  # in the last n % 4 gaps (2001 positions: one)
                     (0, -5)]:            # >= 2**63 as a uint64 position
        p = pos.copy()
        p[i] = value
        assert run(p) == (0, 0, 0, i + 1)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("r", [0, 1, 3, 8, 33, 40])
@pytest.mark.parametrize("dtype", [np.uint32, np.int64])
def test_gaps_split_matches_a_numpy_reference(compiled, r, dtype):
    """Symbols, their counts, the packed low bits, escaped excesses and zero gaps, against
    numpy: escapes (r = 0 with gaps past the cap), every n % 4 tail, shifts past 32."""
    split = kernels.gaps.gaps_split if compiled else kernels.gaps.gaps_split.py_func
    rng = np.random.default_rng(r)
    top = 2**31 if dtype == np.uint32 else 2**50
    for n in (1, 2, 5, 6, 7, 300 if not compiled else 4099):
        p = np.unique(np.concatenate([rng.integers(0, 600, n), rng.integers(0, top, n // 3 + 1)]))[:n]
        p = p.astype(dtype)
        g = np.diff(p.astype(np.int64), prepend=-1) - 1
        q = g >> r
        sym, counts = np.empty(p.size, np.uint8), np.zeros(256, np.int64)
        low, excess = np.empty((p.size * r + 7) // 8, np.uint8), np.empty(p.size, np.int64)
        lows = np.full(-(-p.size // 8) * 8 if 1 <= r <= 8 else 0, 0xA5, np.uint8)  # dirty scratch
        nb, ne, zeros, bad = split(p, r, 255, sym, counts, low, excess, lows)
        assert bad == 0
        np.testing.assert_array_equal(sym, np.minimum(q, 255))
        np.testing.assert_array_equal(counts, np.bincount(np.minimum(q, 255), minlength=256))
        np.testing.assert_array_equal(excess[:ne], q[q >= 255] - 255)
        assert zeros == int(np.count_nonzero(g[1:] == 0))
        bits = "".join(format(int(x) & ((1 << r) - 1), f"0{r}b") for x in g) if r else ""
        bits += "0" * (-len(bits) % 8)
        assert nb == len(bits) // 8
        assert low[:nb].tolist() == [int(bits[k:k + 8], 2) for k in range(0, len(bits), 8)]


@pytest.mark.parametrize("compiled", [True, False])
def test_low_bits_packed_from_bytes_match_the_positions_loop(compiled):
    """`_pack_low_bytes` (shifts 1-8, eight gaps a step from their low bytes, one 8-byte
    store each) writes exactly what `_pack_low_bits` writes from the positions, into an
    array of exactly (n * r + 7) // 8 bytes (the steps whose store would pass its end take
    the bit loop), and nothing past it; a strided output array takes the bit loop."""
    pack = kernels.gaps._pack_low_bytes if compiled else kernels.gaps._pack_low_bytes.py_func
    rng = np.random.default_rng(5)
    for r in range(1, 9):
        for n in list(range(0, 70)) + [1000, 4099]:
            p = np.cumsum(rng.integers(1, 4 << r, n)).astype(np.int64)
            g = np.diff(p, prepend=-1) - 1
            lows = np.zeros(-(-n // 8) * 8, np.uint8)
            lows[:n] = g & ((1 << r) - 1)
            size = (n * r + 7) // 8
            want = np.zeros(size, np.uint8)
            assert kernels.gaps._pack_low_bits(p, r, want) == size
            low = np.full(size + 9, 0xAB, np.uint8)
            assert pack(lows, n, r, low[:size]) == size
            np.testing.assert_array_equal(low[:size], want)
            assert (low[size:] == 0xAB).all()
            strided = np.zeros(2 * size, np.uint8)
            assert pack(lows, n, r, strided[::2]) == size
            np.testing.assert_array_equal(strided[::2], want)


@pytest.mark.parametrize("compiled", [True, False])
def test_symbol_counts_match_bincount(compiled):
    """`_count_symbols`: symbols below 16 counted 64 at a time, the rest one at a time, the
    last n % 64 by the interleaved counters; on contiguous and strided symbols, added to
    the counts already there."""
    count = kernels.gaps._count_symbols if compiled else kernels.gaps._count_symbols.py_func
    rng = np.random.default_rng(6)
    for n in (0, 1, 63, 64, 65, 127, 128, 1000, 5000):
        for top in (1, 15, 16, 17, 256):
            sym = np.minimum(rng.geometric(0.3, n) - 1, top - 1).astype(np.uint8)
            sym[::97] = top - 1
            counts = np.full(256, 3, np.int64)
            count(sym, n, counts)
            np.testing.assert_array_equal(counts, np.bincount(sym, minlength=256) + 3)
            spread = np.zeros(2 * n, np.uint8)
            spread[::2] = sym
            counts = np.zeros(256, np.int64)
            count(spread[::2], n, counts)
            np.testing.assert_array_equal(counts, np.bincount(sym, minlength=256))


def _rice_sample(p: np.ndarray) -> np.ndarray:
    """The gaps `kernels.gaps.rice_shift` estimates on: all of them below 2**15 positions, else
    256 runs of 64 consecutive gaps, run b starting at gap 1 + b * stride (negative ones as 0)."""
    g = np.diff(p, prepend=-1) - 1
    if p.size >= 1 << 15:
        stride = (p.size - 1 - 64) // 255
        g = np.concatenate([g[1 + b * stride:1 + b * stride + 64] for b in range(256)])
    return np.maximum(g, 0)


@pytest.mark.parametrize("compiled", [True, False])
def test_rice_shift_picks_the_smallest_estimate_of_three(compiled):
    """Brute force beside the kernel's one-histogram shortcut: for r in base..base + 2
    (base = floor(log2(mean gap)) - 2), entropy of the capped quotients + r bits per gap
    + 24 bits per escape; the kernel picks the smallest (r = 0 below a mean gap of 2)."""
    shift = kernels.gaps.rice_shift if compiled else kernels.gaps.rice_shift.py_func
    rng = np.random.default_rng(8)
    cap = 255
    cases = [np.arange(5, dtype=np.int64), np.array([7], np.int64), np.array([0, 1, 2, 10**12], np.int64)]
    for n, scale in [(20_000, 33), (3000, 1 << 20), (40_000, 2), (200_000, 5)] if compiled else [(3000, 33)]:
        cases.append(np.sort(rng.choice(n * scale, n, replace=False)).astype(np.int64))
        heavy = np.where(rng.random(n) < 0.05, rng.integers(0, 4000, n) * scale, rng.integers(0, 40, n))
        cases.append(np.cumsum(heavy + 1).astype(np.int64))  # quotients up to and past the cap
    for p in cases:
        g = _rice_sample(p)
        mean = g.sum() / g.size
        if mean < 2:
            assert shift(p, cap) == 0
            continue
        base = max(0, int(np.floor(np.log2(mean))) - 2)
        sizes = []
        for r in (base, base + 1, base + 2):
            counts = np.bincount(np.minimum(g >> r, cap), minlength=cap + 1)
            nz = counts[counts > 0].astype(float)
            sizes.append(float((nz * np.log2(g.size / nz)).sum()) + g.size * r + 24 * counts[cap])
        assert shift(p, cap) == base + int(np.argmin(sizes)), (p.size, sizes)
    assert shift(np.array([0, 5, 3, 100], np.int64), cap) >= 0  # unsorted: negative gaps count as 0


@pytest.mark.parametrize("n", [1, 3, 1000, 100_000, 600_000])
@pytest.mark.parametrize("width", [1, 2])
def test_value_histogram_matches_unique_and_leaves_its_tables_zeroed(n, width):
    """value_histogram (kernels.values.histogram_lines on per-thread tables) gives np.unique's
    answer on skewed, spread and constant values, and leaves its tables all zero, so the
    next call counts from scratch."""
    rng = np.random.default_rng(n + width)
    dt = np.dtype(f"<u{width}")
    top = (1 << (8 * width)) - 1
    for vals in (rng.geometric(0.3, n).astype(dt), rng.integers(0, top + 1, n).astype(dt),
                 np.full(n, 7, dt), np.full(n, top, dt)):
        for _ in range(2):
            distinct, counts = value_histogram(vals, width)
            expect, expect_counts = np.unique(vals, return_counts=True)
            assert distinct.dtype == dt
            np.testing.assert_array_equal(distinct, expect)
            np.testing.assert_array_equal(counts, expect_counts)
            table, lines = _zeroed_tables(width)
            assert not table.any() and not lines.any()


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 33, 4099])
def test_histogram_lines_counts_every_value_once(n):
    """Every value, whatever its place modulo the four counters (and the n % 4 tail), is
    counted once; distinct values come out ascending, the tables zeroed again."""
    rng = np.random.default_rng(n)
    vals = np.concatenate([rng.choice(np.array([0, 1, 2, 3, 4, 255, 65535], np.uint16), n // 2),
                           rng.integers(0, 1 << 16, n - n // 2).astype(np.uint16)])
    table, lines = np.zeros(4 << 16, np.uint32), np.zeros(1 << 14, np.uint8)
    distinct, found = np.empty(max(n, 1), np.uint16), np.empty(max(n, 1), np.int64)
    k = kernels.values.histogram_lines(vals, table, lines, distinct, found)
    expect, expect_counts = np.unique(vals, return_counts=True)
    np.testing.assert_array_equal(distinct[:k], expect)
    np.testing.assert_array_equal(found[:k], expect_counts)
    assert not table.any() and not lines.any()


@pytest.mark.parametrize("compiled", [True, False])
def test_model_bits_sum_each_occurring_symbols_code_length(compiled):
    """kernels.joint.model_bits: sum of c * (16 - log2 f) over the symbols that occur (the joint
    stream's size estimates); symbols with no count cost nothing, whatever their frequency."""
    bits = kernels.joint.model_bits if compiled else kernels.joint.model_bits.py_func
    rng = np.random.default_rng(9)
    for size in (1, 2, 17, 256):
        counts = rng.integers(0, 1000, size).astype(np.int64)
        counts[::3] = 0
        freq = rng.integers(1, 1 << 15, size).astype(np.int64)
        want = sum(int(c) * (16 - np.log2(int(f))) for c, f in zip(counts, freq) if c)
        assert bits(counts, freq) == pytest.approx(want, rel=1e-12, abs=1e-9)
    assert bits(np.array([0, 5], np.int64), np.array([0, 1 << 15], np.int64)) == 5.0


@pytest.mark.parametrize("compiled", [True, False])
def test_histogram_of_few_values_counts_by_compares_and_the_rest_by_the_table(compiled):
    """16-bit values whose first 4096 hold at most 16 distinct ones are counted by 32-lane
    compares (kernels.values._count_few): values the sample never showed, a switch to many values
    after the sample (which stops the compares), exactly 16 and 17 distinct values in the
    sample, every tail modulo 32, a strided array, arrays shorter than the sample (from
    _FEW_MIN values up); always np.unique's answer, the tables zeroed again."""
    hist = kernels.values.histogram_lines if compiled else kernels.values.histogram_lines.py_func
    rng = np.random.default_rng(7)
    x = rng.integers(0, 1 << 15, 40_000).astype(np.uint16)
    ulp = (x ^ (x + rng.choice(np.array([1, 0xFFFF], np.uint16), x.size))).astype(np.uint16)
    rare = ulp.copy()
    rare[5000::3001] = rng.integers(0, 1 << 16, rare[5000::3001].size)  # never in the sample
    switch = np.concatenate([np.full(6000, 9, np.uint16), rng.integers(0, 1 << 16, 30_000).astype(np.uint16)])
    sixteen = rng.choice(np.arange(16, dtype=np.uint16) * 4099, 20_000)
    seventeen = rng.choice(np.arange(17, dtype=np.uint16) * 3, 20_000)
    cases = [ulp, rare, switch, sixteen, seventeen, rng.choice(np.array([1, 0xFFFF], np.uint16), 16_417),
             np.full(16_384 + 31, 0xFFFF, np.uint16), ulp[::2]]
    # short arrays: the whole array (rounded down to 32) is the sample; below _FEW_MIN, the table
    short = [ulp[:1023], ulp[:1024], ulp[:3001], np.concatenate([ulp[:2000], [12345], ulp[:7]]).astype(np.uint16),
             seventeen[:1500]]
    table, lines = np.zeros(4 << 16, np.uint32), np.zeros(1 << 14, np.uint8)
    for vals in (cases if compiled else cases[:3]) + short:
        distinct, found = np.empty(1 << 16, np.uint16), np.empty(1 << 16, np.int64)
        k = hist(vals, table, lines, distinct, found)
        expect, expect_counts = np.unique(vals, return_counts=True)
        np.testing.assert_array_equal(distinct[:k], expect)
        np.testing.assert_array_equal(found[:k], expect_counts)
        assert not table.any() and not lines.any()


@pytest.mark.parametrize("compiled", [True, False])
def test_distinct_sample_values_in_order_of_first_appearance(compiled):
    """kernels.values._distinct_upto, 32 values a step: the sample's distinct values in the order
    they first appear (several new ones in one step, equal lanes taken once), exactly
    few.size of them still fit, one more is -1; only vals[:m] is looked at."""
    distinct_upto = kernels.values._distinct_upto if compiled else kernels.values._distinct_upto.py_func
    rng = np.random.default_rng(11)

    def first_seen(x):
        _, first = np.unique(x, return_index=True)
        return x[np.sort(first)].astype(np.int64)

    cases = [rng.choice(np.array([1, 0x7F, 0x8001, 0xFFFF, 3], np.uint16), 4096, p=[0.6, 0.2, 0.1, 0.05, 0.05]),
             np.repeat(np.array([9, 4, 9, 0, 65535, 4], np.uint16), [5, 1, 40, 3, 7, 8000]),  # new ones mid-step
             rng.choice(np.arange(16, dtype=np.uint16) * 4099, 4096),  # exactly 16
             np.full(64, 7, np.uint16)]
    for vals in cases:
        m = vals.size - vals.size % 32
        few = np.full(16, -5, np.int64)
        k = distinct_upto(vals, m, few)
        want = first_seen(vals[:m])
        assert k == want.size <= 16
        np.testing.assert_array_equal(few[:k], want)
    seventeen = np.concatenate([np.arange(17, dtype=np.uint16) * 3, np.zeros(47, np.uint16)])
    assert distinct_upto(seventeen, 64, np.empty(16, np.int64)) == -1
    assert distinct_upto(seventeen, 64, np.empty(17, np.int64)) == 17
    # the 17th value past m is not looked at
    assert distinct_upto(np.concatenate([np.arange(16, dtype=np.uint16), np.zeros(16, np.uint16),
                                         np.full(32, 99, np.uint16)]), 32, np.empty(16, np.int64)) == 16


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("width", [1, 2])
def test_xor_add_entropies_match_the_histograms_of_both_value_arrays(compiled, width):
    """op "auto"'s choice from (add, new bits): the entropies of new ^ old and of
    new - old (wrapping) equal numpy's from np.unique's counts, the tables come back zero,
    and choose_op_from_add picks what choose_op picks from both arrays."""
    def entropy_bits(counts):  # numpy, independent of the kernel's own sum
        c = counts.astype(np.float64)
        return float((c * (np.log2(c.sum()) - np.log2(c))).sum())

    fn = kernels.values.xor_add_entropies if compiled else kernels.values.xor_add_entropies.py_func
    dt = np.dtype(f"<u{width}")
    rng = np.random.default_rng(width)
    top = 1 << (8 * width)
    table, lines = np.zeros(4 * top, np.uint32), np.zeros(top // 4, np.uint8)
    for n in (0, 1, 5, 4099):
        old = rng.integers(0, top, n).astype(dt)
        steps = rng.choice(np.array([1, top - 1]), n).astype(dt)  # +-1, wrapping
        flips = (1 << rng.integers(0, 8 * width - 1, n)).astype(dt)
        for new in (old + steps, old ^ flips, rng.integers(0, top, n).astype(dt)):
            add = new - old
            room = max(1, min(n, top))
            hx, ha = fn(add, new, table, lines, np.empty(room, dt), np.empty(room, np.int64))
            assert not table.any() and not lines.any()
            want = [entropy_bits(np.unique(v, return_counts=True)[1]) if n else 0.0 for v in (new ^ old, add)]
            assert (hx, ha) == pytest.approx(want, rel=1e-12, abs=1e-9)
            assert choose_op_from_add(add, new, width) is choose_op(new ^ old, add, width)


def test_value_histogram_tables_stay_clean_when_interrupted(monkeypatch):
    """Without numba the counting loop is Python and can be interrupted half-way: the kept
    tables are zeroed again, so the next histogram (and the records coded from it) is right."""
    def interrupted(vals, table, lines, distinct, found):
        table[4 * int(vals[0])] += 5
        lines[int(vals[0]) >> 2] = 1
        raise KeyboardInterrupt

    monkeypatch.setattr(kernels.values, "histogram_lines", interrupted)
    with pytest.raises(KeyboardInterrupt):
        value_histogram(np.array([3, 3, 4], np.uint16), 2)
    monkeypatch.undo()
    distinct, counts = value_histogram(np.array([3, 3, 4], np.uint16), 2)
    assert distinct.tolist() == [3, 4] and counts.tolist() == [2, 1]
    table, lines = _zeroed_tables(2)
    assert not table.any() and not lines.any()
    assert kernels.gaps.rice_shift(np.empty(0, np.int64), 255) == 0


def test_gaps_rans_escapes_and_huge_indices():
    rng = np.random.default_rng(5)
    pos = np.unique(np.concatenate([rng.integers(0, 2**40, 300), [2**63 - 1], [0, 1, 2]]).astype(np.uint64))
    raw, _ = encode_gaps_rans(pos)
    np.testing.assert_array_equal(decode_gaps_rans(raw, pos.size, 2**63), pos)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=3000), st.integers(1, 30))
def test_rans_roundtrip_and_near_entropy(symbols, pad):
    sym = np.array(symbols, np.int32)
    counts = np.bincount(sym, minlength=sym.max() + pad)
    raw = encode_rans(sym, counts)
    rd = Reader(raw)
    out, alphabet = decode_rans(rd, sym.size, 1024, "t")
    rd.done("t")
    assert alphabet == counts.size
    np.testing.assert_array_equal(out, sym)
    nz = counts[counts > 0].astype(float)
    entropy = float((nz * np.log2(sym.size / nz)).sum()) / 8
    words = 0 if nz.size == 1 else 2 * (len(raw) - len(leb128_encode(np.concatenate(
        ([counts.size], quantize(counts), [0])).astype(np.uint64))))
    assert words / 2 <= entropy * 1.01 + 10  # payload words: the entropy, plus flush and quantisation


def test_quantize_sums_and_keeps_every_symbol():
    for counts in ([1, 1], [10**9, 1, 1, 1], [1] * 1025, [5] + [1] * 1024, [0, 3, 0, 7]):
        f = quantize(np.array(counts))
        assert f.sum() == 1 << 16
        assert np.all((f > 0) == (np.array(counts) > 0))


@pytest.mark.parametrize("compiled", [True, False])
def test_rans_model_is_quantize_with_prefix_sums(compiled):
    """kernels.rans.rans_model gives quantize's frequencies (and their exclusive prefix sums)
    wherever it takes the counts, and hands every other case to quantize: -1 for a
    remainder the largest symbol cannot absorb and for sums too large; the number of
    symbols that occur when fewer than two do (nothing written then)."""
    from nemo_dcr.wire.rans import _quantize_general

    model = kernels.rans.rans_model if compiled else kernels.rans.rans_model.py_func
    rng = np.random.default_rng(11)
    cases = [[1, 1], [10**9, 1, 1, 1], [5] + [1] * 1024, [0, 3, 0, 7], [7, 7, 7], [0, 9, 9, 0, 1]]
    cases += [rng.geometric(p, rng.integers(2, 5000)).clip(max=255) for p in (0.01, 0.3, 0.9)]
    cases += [np.bincount(rng.geometric(0.4, n).clip(max=300)) for n in (2, 10, 1000, 10**6)]
    for counts in cases:
        counts = np.asarray(counts, np.int64)
        freq, cum = np.full(counts.size, -5, np.int64), np.full(counts.size, -5, np.int64)
        used = model(counts, freq, cum)
        assert used == np.count_nonzero(counts)
        if used < 2:
            assert (freq == -5).all()
            continue
        np.testing.assert_array_equal(freq, quantize(counts))
        np.testing.assert_array_equal(freq, _quantize_general(counts))  # quantize calls the kernel itself
        np.testing.assert_array_equal(cum, np.concatenate(([0], np.cumsum(freq)[:-1])))
    # 1025 symbols raised to frequency 1 leave the largest too little: quantize's general path
    starved = np.array([2**40] + [1] * 70_000, np.int64)
    assert model(starved, np.empty(starved.size, np.int64), np.empty(starved.size, np.int64)) == -1
    for counts in ([1 << 46, 1], [(1 << 45) + 1, 1 << 45], [3, -1, 4]):  # too large, or negative
        counts = np.array(counts, np.int64)
        assert model(counts, np.empty(counts.size, np.int64), np.empty(counts.size, np.int64)) == -1
    assert model(np.zeros(3, np.int64), np.empty(3, np.int64), np.empty(3, np.int64)) == 0
    assert model(np.array([0, 4], np.int64), np.empty(2, np.int64), np.empty(2, np.int64)) == 1


def test_raw_streams_are_pinned():
    """The coder's output is part of the wire format: raw (pre-zstd) rANS, gaps_rans and
    symbols_rans sections of fixed inputs, hashed from the kernels as first released (and
    gaps_joint / symbols_joint from v5's)."""
    import hashlib

    i = np.arange(20_001, dtype=np.int64)
    sym = ((i * 2654435761) >> 7) % 97
    sym = np.where(sym < 60, sym % 3, sym % 11).astype(np.int32)  # skewed, 11 symbols
    pos = np.unique((i * i * 48271) % 1_000_003).astype(np.uint64)[::3]
    vals = (((i * 40503) >> 5) % 13 + 1).astype(np.uint16)
    raws = {"rans_odd": encode_rans(sym, np.bincount(sym)),
            "rans_even": encode_rans(sym[:-1], np.bincount(sym[:-1])),
            "rans_one": encode_rans(sym[:1], np.bincount(sym[:1])),
            "gaps_rans": encode_gaps_rans(pos)[0],
            "symbols_rans": encode_value_symbols(vals, 2)}
    joint_sections = joint.encode_joint(gaps_parts(pos), value_parts(vals[:pos.size], 2), 1 << 30)
    raws["gaps_joint"], raws["symbols_joint"] = (b"".join(map(bytes, part)) for part in joint_sections)
    pinned = {"rans_odd": "3c7bd2550b889642385649d35fd218de00cbf3e5a7d09e1c791613be53e35bb6",
              "rans_even": "41e7dc638e7b9d16ca9c672c09764faca674156486ea5ff507c25a0b76c9845d",
              "rans_one": "d3330235ada6123cc60e56311f444b5847c228a6e0f53c0f6903dd37e6335cb2",
              "gaps_rans": "51b46dc42f9ceed696d30643ff46a6188def66d79b9977e8b5c054f52d53bef9",
              "symbols_rans": "d44b0b015a4ebcfdd001f161d851cef9f40854928dfb308c99793a085c4150e2",
              "gaps_joint": "c6fe0f1a06c8dbf1325b5f11603fcb09de6ce0ad2a6a52bfb034384b66af5d40",
              "symbols_joint": "fb6e31c61292aa5b55bb4c267b8fec87c9f088da3af99d258f8e47df992b3285"}
    assert {k: hashlib.sha256(v).hexdigest() for k, v in raws.items()} == pinned
    np.testing.assert_array_equal(decode_gaps_rans(raws["gaps_rans"], pos.size, 1_000_003), pos)
    for key, m in (("rans_odd", sym.size), ("rans_even", sym.size - 1)):
        rd = Reader(raws[key])
        np.testing.assert_array_equal(decode_rans(rd, m, 16, "t")[0], sym[:m])
        rd.done("t")


# -------------------------------------------------------------- joint stream (v5)


def _product_reference(f1, f2) -> list[int] | None:
    """rans_product_model in Python integers, as docs/wire-format.md states it (None: the
    largest cell cannot take the remainder)."""
    a2 = len(f2)
    freq = [0] * (len(f1) * a2)
    for q, x in enumerate(f1):
        for v, y in enumerate(f2):
            f = (int(x) * int(y) + (1 << 15)) >> 16
            freq[q * a2 + v] = 1 if f == 0 and x and y else f
    big = max(range(len(freq)), key=lambda k: (freq[k], -k))
    freq[big] += (1 << 16) - sum(freq)
    return freq if freq[big] >= 1 else None


@pytest.mark.parametrize("compiled", [True, False])
def test_product_model_is_the_rounded_product(compiled):
    fn = kernels.joint.rans_product_model if compiled else kernels.joint.rans_product_model.py_func
    rng = np.random.default_rng(5)
    for a1, a2 in [(2, 2), (3, 17), (64, 12), (256, 12), (1, 5), (40, 400)]:
        for trial in range(4):
            c1 = rng.integers(0, 10 ** (trial + 1), a1) * (rng.random(a1) < 0.7)
            c2 = rng.geometric(0.2, a2) ** 3 * (rng.random(a2) < 0.8)
            c1[0] += 1
            c2[-1] += 1
            c1[-1] += a1 > 1
            f1, f2 = quantize(c1), quantize(c2) if np.count_nonzero(c2) > 1 else np.eye(a2, dtype=np.int64)[-1] << 16
            freq = np.empty(a1 * a2, np.int64)
            used = fn(f1, f2, freq)
            ref = _product_reference(f1, f2)
            if ref is None:  # the floors of many cells outweigh the largest: not a model
                assert used == -1
                continue
            assert freq.tolist() == ref
            assert freq.sum() == 1 << 16 and used == np.count_nonzero(freq)
            np.testing.assert_array_equal(freq > 0, np.outer(f1 > 0, f2 > 0).ravel())


def _joint_case(m: int, seed: int):
    """Quotients, values, the values' lut and the two models of a joint stream of m symbols."""
    rng = np.random.default_rng(seed)
    if m < 64:  # fixed models; the symbols within them
        f1, f2 = quantize(np.array([3, 0, 1])), quantize(np.array([1, 1, 2]))
        q = rng.choice([0, 2], m).astype(np.uint8)
        vsym = rng.integers(0, 3, m)
    else:
        q = np.minimum(rng.geometric(0.3, m) - 1, 30).astype(np.uint8)
        vsym = rng.choice(5, m, p=[0.5, 0.25, 0.15, 0.05, 0.05])
        f1, f2 = quantize(np.bincount(q, minlength=31)), quantize(np.bincount(vsym, minlength=5))
    table = np.array([1, 3, 7, 15, 0x8001], np.uint16)[:f2.size]
    lut = np.full(1 << 16, -1, np.int16)
    lut[table] = np.arange(table.size, dtype=np.int16)
    return q, table[vsym], lut, f1, f2


@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 7, 8, 9, 4099, 20_001])
def test_joint_stream_roundtrip(m):
    """Every m % 4 tail, compiled and as Python (the same words), decoded back."""
    q, vals, lut, f1, f2 = _joint_case(m, m)
    freq = np.empty(f1.size * f2.size, np.int64)
    kernels.joint.rans_product_model(f1, f2, freq)
    cum = np.concatenate(([0], np.cumsum(freq)[:-1]))
    words = []
    for enc in (kernels.joint.rans_encode_joint, kernels.joint.rans_encode_joint.py_func):
        out = np.empty(m + 8, "<u2")
        words.append(out[enc(q, vals, lut, f2.size, freq, cum, out):].copy())
    np.testing.assert_array_equal(words[0], words[1])
    got_q, got_v = joint.decode_joint(f1.astype(np.uint64), f2.astype(np.uint64), words[0], m)
    np.testing.assert_array_equal(got_q, q)
    np.testing.assert_array_equal(got_v, lut[vals])
    slots, table = np.empty(1 << 16, np.uint16), np.empty(np.count_nonzero(freq), np.uint64)
    assert kernels.joint.rans_joint_table.py_func(freq, f2.size, np.arange(f2.size), slots, table) == 0
    qq, vv = np.empty(m, np.uint8), np.empty(m, np.int16)
    assert kernels.joint.rans_decode_joint.py_func(words[0], slots, table, qq, vv) == 0
    np.testing.assert_array_equal(qq, q)
    np.testing.assert_array_equal(vv, lut[vals])
    # with the values' table the decoder writes the values themselves
    value_table = np.zeros(f2.size, np.uint16)
    value_table[lut[vals]] = vals  # value symbol -> value
    got_q, got_vals = joint.decode_joint(f1.astype(np.uint64), f2.astype(np.uint64), words[0], m, value_table)
    np.testing.assert_array_equal(got_q, q)
    assert got_vals.dtype == np.uint16
    np.testing.assert_array_equal(got_vals, vals)
    if m >= 64:  # near the two streams' entropy
        bits = sum(float((c[c > 0] * np.log2(c.sum() / c[c > 0])).sum())
                   for c in (np.bincount(q), np.bincount(lut[vals])))
        assert words[0].size * 16 < bits * 1.01 + 8 * 16


@pytest.mark.parametrize("compiled", [True, False])
def test_joint_table_covers_every_slot_or_refuses(compiled):
    """Each used cell's entry names its frequency, its range's first slot, its quotient and
    its value symbol's field (the symbol, or the value the map gives it); the indexed form
    names every slot's cell, the per-slot form holds every slot's entry. A model that does
    not cover the 2**16 slots exactly, or tables too small for it, are refused (-1),
    leaving no slot unwritten behind a 0."""
    build = kernels.joint.rans_joint_table if compiled else kernels.joint.rans_joint_table.py_func
    freq = np.array([0, 40000, 1, 0, 25534, 1], np.int64)  # a2 = 3: cells (0,0) .. (1,2)
    used = np.flatnonzero(freq)
    sym = np.repeat(np.arange(freq.size), freq)
    start = np.concatenate(([0], np.cumsum(freq)[:-1]))
    values = np.array([7, 0xFFFF, 0x8001], np.uint16)
    for form in (np.uint8, np.uint16, None):  # the index's type, or per slot
        for vmap, field in ((np.arange(3), sym % 3), (values, values[sym % 3])):  # value symbols, or values
            if form is None:
                slots, table = np.zeros(0, np.uint8), np.zeros(1 << 16, np.uint64)
            else:
                slots, table = np.zeros(1 << 16, form), np.zeros(used.size, np.uint64)
            assert build(freq, 3, vmap, slots, table) == 0
            entry = table if form is None else table[slots]  # each slot's entry
            if form is not None:
                np.testing.assert_array_equal(used[slots], sym)
            np.testing.assert_array_equal(entry & 0xFFFF, freq[sym])
            np.testing.assert_array_equal((entry >> 16) & 0xFFFF, start[sym])
            np.testing.assert_array_equal((entry >> 32) & 0xFF, sym // 3)
            np.testing.assert_array_equal(entry >> 40, field)
    for bad in ([1 << 16, 0], [40000, 25535], [40000, 25537], [-1, 1 << 16, 1]):
        bad = np.array(bad, np.int64)
        assert build(bad, 2, np.arange(2), np.zeros(1 << 16, np.uint16), np.zeros(3, np.uint64)) == -1, bad
        assert build(bad, 2, np.arange(2), np.zeros(0, np.uint16), np.zeros(1 << 16, np.uint64)) == -1, bad
    ok = np.array([40000, 25536], np.int64)
    assert build(ok, 2, np.arange(2), np.zeros(1 << 16, np.uint16), np.zeros(1, np.uint64)) == -1  # cells short
    assert build(ok, 2, np.arange(2), np.zeros(1 << 15, np.uint16), np.zeros(2, np.uint64)) == -1  # index short
    assert build(ok, 2, np.arange(2), np.zeros(0, np.uint16), np.zeros(1 << 15, np.uint64)) == -1  # per slot, short
    many = np.full(300, 218, np.int64)
    many[0] += (1 << 16) - many.sum()
    assert build(many, 300, np.arange(300), np.zeros(1 << 16, np.uint8), np.zeros(300, np.uint64)) == -1  # > 256 cells
    assert build(many, 300, np.arange(300), np.zeros(1 << 16, np.uint16), np.zeros(300, np.uint64)) == 0


def _joint_stream(m: int, seed: int):
    """`_joint_case` coded: (q, values, lut, f1, f2, the product model, the stream's words)."""
    q, vals, lut, f1, f2 = _joint_case(m, seed)
    freq = np.empty(f1.size * f2.size, np.int64)
    kernels.joint.rans_product_model(f1, f2, freq)
    cum = np.concatenate(([0], np.cumsum(freq)[:-1]))
    out = np.empty(m + 8, "<u2")
    words = out[kernels.joint.rans_encode_joint(q, vals, lut, f2.size, freq, cum, out):]
    return q, vals, lut, f1, f2, freq, words


@pytest.mark.parametrize("per_slot", [True, False])
def test_joint_decoder_tables_decode_alike(monkeypatch, per_slot):
    """Either table form (chosen per host by its L2) decodes a joint stream to the same
    quotients and values, compiled and as Python."""
    m = 3001
    q, vals, lut, f1, f2, freq, words = _joint_stream(m, 7)
    monkeypatch.setattr(joint, "PER_SLOT_TABLE", per_slot)
    got_q, got_v = joint.decode_joint(f1.astype(np.uint64), f2.astype(np.uint64), words, m)
    np.testing.assert_array_equal(got_q, q)
    np.testing.assert_array_equal(got_v, lut[vals])
    if per_slot:
        slots, table = np.zeros(0, np.uint8), np.empty(1 << 16, np.uint64)
    else:
        slots, table = np.zeros(1 << 16, np.uint16), np.empty(np.count_nonzero(freq), np.uint64)
    assert kernels.joint.rans_joint_table(freq, f2.size, np.arange(f2.size), slots, table) == 0
    qq, vv = np.empty(m, np.uint8), np.empty(m, np.int16)
    assert kernels.joint.rans_decode_joint.py_func(words, slots, table, qq, vv) == 0
    np.testing.assert_array_equal(qq, q)
    np.testing.assert_array_equal(vv, lut[vals])


def _two_passes(gaps, f2, numel, values=None):
    """`joint.decode_joint_gaps` as two passes: the joint stream's quotients, then their join."""
    q, v = joint.decode_joint(gaps.model, f2, gaps.words, gaps.count, values)
    return gaps.positions(q, numel), v


def _escaping_positions(rng, n: int) -> np.ndarray:
    """3% of n elements in three stretches with gaps of ~n/4 between them (escaped quotients)."""
    parts = [np.flatnonzero(rng.random(n // 8) < 0.03) + k * (n // 3) for k in range(3)]
    return np.concatenate(parts).astype(np.uint64)


@pytest.mark.parametrize("per_slot", [True, False])
@pytest.mark.parametrize("rate", [0.003, 0.03, 0.1, 0.3])
def test_joint_gaps_in_one_pass_decode_as_two(monkeypatch, per_slot, rate):
    """The joint stream decoded with its gaps joined on the way (`decode_joint_gaps`:
    `kernels.joint.rans_decode_joint_gaps`, then `gaps_escapes` for the escaped quotients)
    gives the positions and values of the two passes, for Rice shifts from 1 up (0, at
    30%, decodes in two passes), with and without escapes, in either table form, compiled
    and as Python."""
    monkeypatch.setattr(joint, "PER_SLOT_TABLE", per_slot)
    calls = []
    one_pass_kernel = kernels.joint.rans_decode_joint_gaps
    monkeypatch.setattr(kernels.joint, "rans_decode_joint_gaps", lambda *a: calls.append(a[5]) or one_pass_kernel(*a))
    rng = np.random.default_rng(int(rate * 1000))
    n = int(12_000 / rate)  # 12,000 changes, and 13,500 in the escaping case
    for pos in (np.flatnonzero(rng.random(n) < rate).astype(np.uint64), _escaping_positions(rng, 400_000)):
        n = max(n, int(pos[-1]) + 1)
        vals = rng.integers(1, 9, pos.size).astype(np.uint16)
        data = codec.encode(Payload(HDR, [Record("w", "BF16", (n,), Op.ADD, pos, vals)]), dense="never")
        assert '"gaps_joint"' in codec.header_text(data)
        for one_pass in (joint.decode_joint_gaps, _two_passes):
            monkeypatch.setattr(codec, "decode_joint_gaps", one_pass)
            out = codec.decode(data).records[0]
            np.testing.assert_array_equal(out.positions, pos)
            np.testing.assert_array_equal(out.values, vals)
    # the first case's Rice shift; 0 (no low bits) takes the two passes
    assert calls == [{0.003: 6, 0.03: 3, 0.1: 1}[rate], 4] if rate < 0.3 else calls == [4]
    assert gaps_parts(pos).excess.size >= 2  # the last case escapes
    monkeypatch.setattr(kernels.joint, "rans_decode_joint_gaps", one_pass_kernel.py_func)
    monkeypatch.setattr(kernels.gaps, "gaps_escapes", kernels.gaps.gaps_escapes.py_func)
    monkeypatch.setattr(codec, "decode_joint_gaps", joint.decode_joint_gaps)
    np.testing.assert_array_equal(codec.decode(data).records[0].positions, pos)



def _same_split(a, b) -> None:
    assert a.shift == b.shift and a.zeros == b.zeros
    for field in ("sym", "counts", "low", "excess"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


def test_gaps_parts_in_scratch_match_fresh_memory(monkeypatch):
    """gaps_parts(reuse=True) gives the split of fresh memory after a larger split and a
    smaller one dirtied the thread's scratch (shifts 1-8 and 0, escapes included), and
    hands out more than its cap as fresh memory."""
    rng = np.random.default_rng(11)
    cases = [np.flatnonzero(rng.random(n) < rate).astype(np.uint64)
             for n, rate in [(300_000, 0.05), (2_000_000, 0.003), (40_000, 0.6), (9_000, 0.01)]]
    cases.append(_escaping_positions(rng, 400_000))
    for pos in cases:
        fresh = gaps_parts(pos)
        gaps_parts(cases[1], reuse=True)  # dirty: the largest split
        gaps_parts(cases[3], reuse=True)
        _same_split(gaps_parts(pos, reuse=True), fresh)
    monkeypatch.setattr("nemo_dcr.wire.gaps._SCRATCH_CAP", 1 << 12)
    pos = np.arange(0, 4 * 6000, 4, dtype=np.uint64)  # symbols alone past the cap
    first, second = gaps_parts(pos, reuse=True), gaps_parts(pos[1:], reuse=True)
    assert not np.shares_memory(first.sym, second.sym)


def test_threads_splitting_at_once_keep_their_own_scratch():
    """Payloads encoded on four threads at once (the producer's encode threads) are the
    bytes one thread gives: each thread's splits use its own scratch."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(12)
    payloads = []
    for k in range(16):
        n = int(rng.integers(50_000, 400_000))
        pos = np.flatnonzero(rng.random(n) < rng.choice([0.01, 0.05, 0.2])).astype(np.uint64)
        vals = (rng.integers(1, 4, pos.size) * rng.choice([1, -1], pos.size)).astype(np.uint16)
        payloads.append(Payload(HDR, [Record(f"w{k}.{j}", "BF16", (n,), Op.XOR, pos[j::2], vals[j::2])
                                      for j in range(2)]))
    want = [codec.encode(p) for p in payloads]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert list(pool.map(codec.encode, payloads)) == want


def _raw_join(sym: np.ndarray, r: int, low: np.ndarray) -> np.ndarray:
    """The positions `rans_decode_joint_gaps` leaves for `gaps_escapes`: every gap's
    quotient as its symbol (escapes too), its r low bits from `low`."""
    bits = np.unpackbits(low)[:sym.size * r].reshape(sym.size, r) if r else np.zeros((sym.size, 0), np.uint8)
    lows = (bits.astype(np.int64) << np.arange(r - 1, -1, -1)).sum(axis=1) if r else 0
    return np.cumsum(((sym.astype(np.int64) << r) | lows) + 1) - 1


@pytest.mark.parametrize("compiled", [True, False])
def test_gaps_escapes_checks_as_gaps_join(compiled):
    """`gaps_escapes` on the one-pass decoder's positions gives `gaps_join`'s positions and
    status: escapes' excesses added, and the first refusal (an excess too large, a position
    past max_pos before or after an escape, non-zero padding) named as gaps_join names it."""
    fn = kernels.gaps.gaps_escapes if compiled else kernels.gaps.gaps_escapes.py_func
    rng = np.random.default_rng(3)
    pos = _escaping_positions(rng, 400_000)
    gp = gaps_parts(pos)
    r, esc, n = gp.shift, 255, pos.size
    big = ((1 << 63) - 1 >> r) - esc
    padded = gp.low.copy()
    padded[-1] |= 1  # n * r = 13,554 * 3 bits: the last byte has padding
    cases = [(gp.low, gp.excess, int(pos[-1])),  # valid
             (gp.low, gp.excess, int(pos[-1]) - 1),  # the last position past max_pos
             (gp.low, gp.excess, int(pos[100])),  # past it before the first escape
             (gp.low, np.array([big + 1, 0], np.int64), 1 << 62),  # an excess too large
             (gp.low, np.array([big, 0], np.int64), 1 << 62),  # the largest excess, then past max_pos
             (padded, gp.excess, int(pos[-1])),  # non-zero padding
             (gp.low, np.zeros(0, np.int64), 1 << 62)]  # no escapes: the bound and the padding only
    statuses = set()
    for low, excess, max_pos in cases:
        want = np.empty(n, np.int64)
        status = kernels.gaps.gaps_join(gp.sym, esc, r, low, excess, max_pos, want, True)
        sym = gp.sym if excess.size else np.minimum(gp.sym, esc - 1)  # without escapes: none in the symbols
        if not excess.size:
            status = kernels.gaps.gaps_join(sym, esc, r, low, excess, max_pos, want, True)
        got = _raw_join(sym, r, low)
        assert fn(got, esc, r, low, excess, max_pos) == status
        statuses.add(status)
        if status == 0:
            np.testing.assert_array_equal(got, want)
    assert statuses == {0, -2, -4, -5}
    assert gp.excess.size == 2 and (n * r) % 8


def test_joint_gaps_in_one_pass_reject_as_two(monkeypatch):
    """Damaged `gaps_joint` sections (the stream's words, the low bits, the escapes'
    excesses, the padding; bits flipped or the section cut) are refused with the reason
    the two passes give, or decode to the same record."""
    rng = np.random.default_rng(5)
    n = 300_000
    pos = _escaping_positions(rng, n)
    vals = rng.integers(1, 9, pos.size).astype(np.uint16)
    data = codec.encode(Payload(HDR, [Record("w", "BF16", (n,), Op.ADD, pos, vals)]))

    def at_end(seed):  # flip a bit in the section's last 64 bytes: low bits, escapes, padding
        def damage(b):
            r = np.random.default_rng(seed)
            b[len(b) - 1 - int(r.integers(0, 64))] ^= 1 << int(r.integers(0, 8))
            return b
        return damage

    reasons = []
    for i in range(80):
        bad = _resealed(data, "positions", at_end(i) if i % 2 else _random_damage(i))
        got = []
        for decode in (joint.decode_joint_gaps, _two_passes):
            monkeypatch.setattr(codec, "decode_joint_gaps", decode)
            try:
                rec = codec.decode(bad).records[0]
                got.append((rec.positions.tobytes(), rec.values.tobytes()))
            except PayloadRejected as e:
                got.append(e.reason)
        assert got[0] == got[1], i
        reasons.append(got[0] if isinstance(got[0], str) else None)
    kinds = {r.split("positions:")[-1].strip()[:24] for r in reasons if r}
    assert len(kinds) >= 4, kinds


def test_joint_table_choice_follows_the_l2(monkeypatch):
    """The per-slot table where the L2 holds it (1 MiB or more), the indexed one below
    that or where the size is not told; NEMO_DCR_JOINT_TABLE overrides, and a value it
    does not know is an error naming it."""
    monkeypatch.delenv("NEMO_DCR_JOINT_TABLE", raising=False)
    for l2, per_slot in ((512 << 10, False), (1 << 20, True), (2 << 20, True), (0, False)):
        monkeypatch.setattr(joint, "_l2_bytes", lambda l2=l2: l2)
        assert joint._per_slot_table() is per_slot, l2
    monkeypatch.setenv("NEMO_DCR_JOINT_TABLE", "slot")
    assert joint._per_slot_table() is True
    monkeypatch.setenv("NEMO_DCR_JOINT_TABLE", "indexed")
    monkeypatch.setattr(joint, "_l2_bytes", lambda: 2 << 20)
    assert joint._per_slot_table() is False
    monkeypatch.setenv("NEMO_DCR_JOINT_TABLE", "Slot")
    with pytest.raises(ValueError, match="NEMO_DCR_JOINT_TABLE='Slot'"):
        joint._per_slot_table()


def test_joint_stream_rejections():
    """A damaged joint stream is a PositionsError naming the kernel's reason, every status."""
    m = 5000
    q, vals, lut, f1, f2, freq, words = _joint_stream(m, 1)
    f1u, f2u = f1.astype(np.uint64), f2.astype(np.uint64)

    def reason(w, n=m, a=f1u, b=f2u):
        with pytest.raises(PositionsError) as e:
            joint.decode_joint(a, b, np.asarray(w, "<u2"), n)
        return str(e.value)
    assert "bad initial states" in reason(words[:7])
    bad = words.copy()
    bad[3] = 0  # x1 < 2**16
    assert "bad initial states" in reason(bad)
    assert "words run out" in reason(words, m + 40)
    assert "does not end where its symbols do" in reason(np.append(words, 7))
    assert "does not end where its symbols do" in reason(words, m - 1)
    flipped = words.copy()
    flipped[len(words) // 2] ^= 0x100
    assert "joint rANS stream" in reason(flipped)
    assert "fewer than two symbols" in reason(words, a=np.array([1 << 16], np.uint64), b=np.array([1 << 16], np.uint64))
    big = np.ones(2 * joint.MAX_CELLS // 2 + 2, np.uint64)
    big[0] += (1 << 16) - big.sum()
    assert "exceed" in reason(words, a=big, b=np.array([1 << 15, 1 << 15], np.uint64))


@pytest.mark.parametrize("compiled", [True, False])
def test_joint_model_decides_as_the_separate_calls(compiled):
    """kernels.joint.joint_model: 1 with the product model and its exclusive prefix sums exactly
    when the values' bits fit the budget, the product has two or more cells and its
    estimated rounding is within max_excess of the two streams' bits, as model_bits,
    rans_product_model and joint_excess_bits say one by one; 0 otherwise."""
    fn = kernels.joint.joint_model if compiled else kernels.joint.joint_model.py_func
    rng = np.random.default_rng(4)
    c1 = np.bincount(np.minimum(rng.geometric(0.2, 50_000) - 1, 40), minlength=41).astype(np.int64)
    c2 = np.bincount(rng.choice(6, 50_000, p=[0.4, 0.3, 0.15, 0.1, 0.04, 0.01]), minlength=6).astype(np.int64)
    f1, f2 = quantize(c1), quantize(c2)
    bits2 = kernels.joint.model_bits(c2, f2)
    want = np.empty(f1.size * f2.size, np.int64)
    assert kernels.joint.rans_product_model(f1, f2, want) >= 2
    excess = kernels.joint.joint_excess_bits(f1, f2, c1, c2, want)
    ratio = excess / (kernels.joint.model_bits(c1, f1) + bits2)
    for value_bits, max_excess, take in ((bits2 + 1, 1.0, 1), (bits2 - 1, 1.0, 0),
                                         (1e18, ratio * 1.01, 1), (1e18, ratio * 0.99, 0)):
        freq, cum = np.full(want.size, -7, np.int64), np.full(want.size, -7, np.int64)
        assert fn(f1, f2, c1, c2, value_bits, max_excess, freq, cum) == take
        if take:
            np.testing.assert_array_equal(freq, want)
            np.testing.assert_array_equal(cum, np.concatenate(([0], np.cumsum(want)[:-1])))
    one = np.array([1 << 16], np.int64)  # a product of one cell: two streams
    assert fn(one, one, np.array([9], np.int64), np.array([9], np.int64), 1e18, 1.0,
              np.empty(1, np.int64), np.empty(1, np.int64)) == 0


def test_joint_encoder_keeps_two_streams_when_the_product_does_not_pay():
    """Many distinct values (a product of too many cells) or a one-symbol model: None."""
    rng = np.random.default_rng(2)
    pos = np.flatnonzero(rng.random(400_000) < 0.03).astype(np.uint64)
    gp = gaps_parts(pos)
    few = value_parts(rng.integers(1, 9, pos.size).astype(np.uint16), 2)
    assert joint.encode_joint(gp, few, pos.size) is not None
    assert joint.encode_joint(gp, few, 100) is None  # values over the budget: planes are tried
    many = value_parts(rng.integers(1, 1000, pos.size).astype(np.uint16), 2)
    assert gp.counts.size * many.counts.size > joint.MAX_CELLS and joint.encode_joint(gp, many, pos.size) is None
    one = value_parts(np.full(pos.size, 5, np.uint16), 2)
    assert joint.encode_joint(gp, one, pos.size) is None


def _add_payload(n: int) -> tuple[np.ndarray, bytes]:
    """The positions and the encoded payload of an add record "w": 3% of n elements, values 1-8."""
    rng = np.random.default_rng(1)
    pos = np.flatnonzero(rng.random(n) < 0.03).astype(np.uint64)
    vals = rng.integers(1, 9, pos.size).astype(np.uint16)
    return pos, codec.encode(Payload(HDR, [Record("w", "BF16", (n,), Op.ADD, pos, vals)]))


@pytest.mark.parametrize("part", ["positions", "values"])
def test_damaged_joint_sections_are_rejected_cleanly(part):
    pos, data = _add_payload(200_000)
    assert '"gaps_joint"' in codec.header_text(data) and '"symbols_joint"' in codec.header_text(data)
    codec.decode(_resealed(data, part, lambda b: b))  # resealing alone is accepted
    reasons = set()
    for i in range(40):
        try:
            out = codec.decode(_resealed(data, part, _random_damage(i))).records[0]
        except PayloadRejected as e:
            assert "'w'" in e.reason and not e.reason.startswith("malformed payload ("), e.reason
            reasons.add(e.reason.split(":")[1].strip()[:20])
            continue
        assert out.positions.size == pos.size  # a flip that still decodes: a valid record
    assert len(reasons) >= 3


# -------------------------------------------------------------- same bits without numba


def test_python_fallback_gives_identical_bits(monkeypatch):
    """Every kernel run as plain Python (numba absent) encodes exactly the same payload."""
    rng = np.random.default_rng(11)
    recs = []
    for i, (n, rate) in enumerate([(3000, 0.02), (2000, 0.4), (500, 1.0), (4000, 0.005), (20000, 0.3),
                                   (200_000, 0.03)]):
        pos = np.flatnonzero(rng.random(n) < rate).astype(np.uint64)
        vals = rng.integers(1, 9, pos.size).astype(np.uint16)
        recs.append(Record(f"w{i}", "BF16", (n,), Op.ADD if i % 2 else Op.XOR, pos, vals))
    p = Payload(HDR, recs)
    compiled = codec.encode(p)
    assert '"gaps_joint"' in codec.header_text(compiled) and '"gaps_rans"' in codec.header_text(compiled)  # w5 (6000 changes): one joint stream
    a = np.arange(5000, dtype=np.int16)
    b = a.copy()
    b[::7] += 1
    piece = Piece("c", 0, 50, 100, 7, 300)
    local = np.flatnonzero(a != b).astype(np.int64)
    d_compiled = _diff_compiled(a, b)
    placed_compiled = piece.canonical_index(local)
    for module, names in (
            (kernels.diff, ("diff_words", "diff16", "diff16_bitscan")),
            (kernels.place, ("affine_index",)),
            (kernels.varints, ("leb128", "leb128_parse", "runs_leb128", "model_parse")),
            (kernels.gaps, ("strictly_increasing_below", "gaps_split", "gaps_join", "rice_shift", "gaps_escapes")),
            (kernels.rans, ("rans_encode", "rans_encode2", "rans_decode", "rans_decode2", "rans_slot_table")),
            (kernels.joint, ("rans_product_model", "joint_excess_bits", "model_bits", "rans_encode_joint",
                             "rans_joint_table", "rans_decode_joint", "rans_decode_joint_gaps", "joint_model")),
            (kernels.values, ("histogram_lines", "map_symbols", "lookup", "xor_add_entropies", "entropy_of_counts"))):
        for name in names:
            monkeypatch.setattr(module, name, getattr(module, name).py_func)
    assert codec.encode(p) == compiled
    for x, y in zip(_diff_compiled(a, b), d_compiled):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(piece.canonical_index(local), placed_compiled)
    out = codec.decode(compiled)
    for r, q in zip(out.records, recs):
        np.testing.assert_array_equal(r.positions, q.positions)
        np.testing.assert_array_equal(r.values, q.values)
    monkeypatch.setattr(kernels.common, "HAVE_NUMBA", False)  # the numpy paths of diff / placement / checks
    assert codec.encode(p) == compiled
    np.testing.assert_array_equal(piece.canonical_index(local), placed_compiled)


# -------------------------------------------------------------- damaged sections


def _gaps_raw():
    rng = np.random.default_rng(3)
    pos = np.flatnonzero(rng.random(20_000) < 0.03).astype(np.uint64)
    return pos, encode_gaps_rans(pos)[0]


def test_damaged_gaps_rans_only_raise_positions_error():
    pos, raw = _gaps_raw()
    rng = np.random.default_rng(7)
    accepted = 0
    for i in range(400):
        b = bytearray(raw)
        kind = i % 3
        if kind == 0:
            for _ in range(int(rng.integers(1, 4))):
                j = int(rng.integers(0, len(b)))
                b[j] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:
            b = b[: int(rng.integers(0, len(b)))]
        else:
            b += bytes(rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8))
        try:
            out = decode_gaps_rans(bytes(b), pos.size, 20_000)
        except PositionsError:
            continue
        accepted += 1
        assert out.size == pos.size and np.all(np.diff(out.astype(np.int64)) > 0) and int(out[-1]) < 20_000
    assert accepted < 100  # flips in the raw low bits are undetectable here (the checksum catches them)


def test_rans_stream_rejections():
    sym = np.array([0, 1, 1, 2, 0, 1] * 50, np.int32)
    raw = encode_rans(sym, np.bincount(sym))

    def dec(data, m=sym.size):
        decode_rans(Reader(data), m, 16, "t")

    dec(raw)
    head = leb128_encode(np.array([3], np.uint64)).tobytes()
    with pytest.raises(PositionsError, match="do not sum"):
        dec(head + leb128_encode(np.array([100, 100, 100, 0], np.uint64)).tobytes())
    with pytest.raises(PositionsError, match="malformed rANS stream"):
        dec(head + leb128_encode(np.array([1 << 15, 1 << 14, 1 << 14, 2], np.uint64)).tobytes() + b"\1\0\1\0")
    with pytest.raises(PositionsError, match="out of range"):
        dec(head + leb128_encode(np.array([1 << 15, 1 << 14, 1 << 14, 10**6], np.uint64)).tobytes())
    with pytest.raises(PositionsError, match="corrupt rANS stream"):
        dec(raw, sym.size + 1)  # one symbol more than was coded
    with pytest.raises(PositionsError, match="corrupt rANS stream"):
        dec(raw, sym.size - 1)
    one = encode_rans(np.zeros(5, np.int32), np.array([5, 0]))
    with pytest.raises(PositionsError, match="no words"):
        dec(one[:-1] + b"\4" + b"\0" * 8, 5)


def _resealed(data: bytes, part: str, damage) -> bytes:
    """Damage the raw bytes of a section of the first record (stored, or decompressed and
    recompressed), reseal (XXH3-128 trailer)."""
    import json
    import struct

    import xxhash
    import zstandard

    hlen = struct.unpack("<I", data[8:12])[0]
    header = json.loads(data[12:12 + hlen])
    body = data[12 + hlen:len(data) - CHECKSUM_BYTES]
    secs = []
    for r in header["records"]:
        for k in ("positions", "values"):
            s = r[k]
            if "offset" in s:
                secs.append((r, k, body[s["offset"]:s["offset"] + s["length"]]))
    out, cursor, raw_total = [], 0, 0
    for i, (r, k, frame) in enumerate(secs):
        stored = r[k].get("stored", False)
        raw = frame if stored or not frame else zstandard.ZstdDecompressor().decompress(frame)
        if i == (0 if part == "positions" else 1):
            raw = damage(bytearray(raw))
        if stored or not raw:
            frame = bytes(raw)
        else:
            frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(raw))
        r[k].update(offset=cursor, length=len(frame), raw_length=len(raw))
        out.append(frame)
        cursor += len(frame)
        raw_total += len(raw)
    header["body_bytes"], header["raw_bytes"] = cursor, raw_total
    hb = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    blob = data[:8] + struct.pack("<I", len(hb)) + hb + b"".join(out)
    return blob + xxhash.xxh3_128_digest(blob)


@pytest.mark.parametrize("part", ["positions", "values"])
def test_damaged_rans_sections_are_rejected_cleanly(part):
    _, data = _add_payload(50_000)
    assert "gaps_rans" in data.decode("latin-1") and "symbols_rans" in data.decode("latin-1")
    codec.decode(_resealed(data, part, lambda b: b))  # resealing alone is accepted
    damages = [lambda b: b[:len(b) // 2], lambda b: b + b"\0\1", lambda b: b[:3] + bytes([b[3] ^ 0x40]) + b[4:],
               lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:] if part == "values" else b[:-1]]
    for damage in damages:
        with pytest.raises(PayloadRejected) as ei:
            codec.decode(_resealed(data, part, damage))
        assert not ei.value.reason.startswith("malformed payload ("), ei.value.reason


def test_decoder_rejects_unknown_encoding_by_name():
    import xxhash

    data = codec.encode(Payload(HDR, [Record("w", "BF16", (50_000,), Op.ADD,
                                             np.arange(0, 50_000, 7, dtype=np.uint64),
                                             np.ones(7143, np.uint16))]))
    blob = data.replace(b'"gaps_rans"', b'"gaps_ranz"')[:-CHECKSUM_BYTES]
    with pytest.raises(PayloadRejected, match="unknown position encoding 'gaps_ranz'"):
        codec.decode(blob + xxhash.xxh3_128_digest(blob))


@needs_numba
def test_kernels_are_compiled():
    assert hasattr(kernels.rans.rans_encode, "signatures")


@needs_numba
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="checks x86-64 instructions")
def test_streaming_kernels_prefetch():
    """The 16-bit diff scans prefetch both inputs ahead, and the sparse apply the lines it
    is about to write (a hint: no output depends on it, so only the compiled code shows it)."""
    import numba  # compiled afresh (the kernels' own dispatchers load cached code, which has no listing)

    a = np.zeros(4 * kernels.diff.DIFF_PREFETCH, np.int16)
    buf = np.empty(len(a), np.int32), np.empty(len(a), np.int16), np.empty(len(a), np.int16)
    scans = [kernels.diff.diff16_bitscan] + ([kernels.diff.diff16] if kernels.diff.HAVE_VECTOR_DIFF else [])
    for kernel in scans + [kernels.scatter.scatter_apply]:
        fn = numba.njit(kernel.py_func)
        if kernel is kernels.scatter.scatter_apply:
            fn(a.view(np.uint16), np.arange(100, dtype=np.int64), np.ones(100, np.uint16), 1)
        else:
            fn(a, a.copy(), 0, 0, *buf, kernels.diff.DIFF_ADD, 0, *kernels.diff.NO_ROWS)
        assert any("prefetcht0" in asm for asm in fn.inspect_asm().values()), kernel.__name__


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("op", [0, 1, 2])
@pytest.mark.parametrize("count", [0, 1, kernels.scatter._SCATTER_PREFETCH, 700])
def test_scatter_apply_matches_numpy(width, op, count):
    """The receiver's compiled sparse apply (xor / wrapping add / set) against numpy; counts
    below, at and above the distance it prefetches ahead (every change in its tail loop, or
    most before it)."""
    rng = np.random.default_rng(width * 10 + op + count)
    dt = np.dtype(f"<u{width}")
    flat = rng.integers(0, np.iinfo(dt).max, 5000, dtype=dt, endpoint=True)
    pos = np.sort(rng.choice(5000, count, replace=False)).astype(np.uint64)
    vals = rng.integers(0, np.iinfo(dt).max, count, dtype=dt, endpoint=True)
    want = flat.copy()
    idx = pos.astype(np.int64)
    with np.errstate(over="ignore"):
        want[idx] = [want[idx] ^ vals, want[idx] + vals, vals][op]
    for fn in (kernels.scatter.scatter_apply, kernels.scatter.scatter_apply.py_func):
        for p in (pos.view(np.int64), pos.astype(np.uint32)):
            got = flat.copy()
            with np.errstate(over="ignore"):  # the plain-Python twin's wrapping add
                assert fn(got, p, vals, op) == 0
            assert np.array_equal(got, want)


@pytest.mark.parametrize("op", [0, 1, 2])
@pytest.mark.parametrize("bad, at, why", [
    (lambda p: p.__setitem__(500, p[499]), 500, "repeated"),
    (lambda p: p.__setitem__(0, 5000), 0, "first-past-the-end"),
    (lambda p: p.__setitem__(699, 5000), 699, "last-past-the-end"),
    (lambda p: p.__setitem__(300, -1), 300, "negative"),  # a uint64 of 2**63 or more, viewed signed
    (lambda p: p.__setitem__(slice(200, 202), p[200:202][::-1].copy()), 201, "pair-swapped"),
], ids=["repeated", "first-past-the-end", "last-past-the-end", "negative", "pair-swapped"])
def test_scatter_apply_stops_at_a_bad_position(op, bad, at, why):
    """The scatter checks the positions as it writes: it returns 1 + the index of the first
    that is not strictly increasing or not in [0, size), having applied the changes before
    it and none from it on (the runtime takes those back)."""
    rng = np.random.default_rng(op)
    flat = rng.integers(0, 1 << 16, 5000, dtype=np.uint16)
    pos = np.sort(rng.choice(5000, 700, replace=False)).astype(np.int64)
    bad(pos)
    vals = rng.integers(1, 1 << 16, 700, dtype=np.uint16)
    want = flat.copy()
    idx = pos[:at]
    with np.errstate(over="ignore"):
        want[idx] = [want[idx] ^ vals[:at], want[idx] + vals[:at], vals[:at]][op]
    for fn in (kernels.scatter.scatter_apply, kernels.scatter.scatter_apply.py_func):
        got = flat.copy()
        with np.errstate(over="ignore"):
            assert fn(got, pos, vals, op) == at + 1, why
        assert np.array_equal(got, want), why


def test_entropy_bits_skips_zero_counts():
    """values.entropy_bits (through kernels.values.entropy_of_counts): counts of zero add nothing."""
    from nemo_dcr.wire.values import entropy_bits

    assert entropy_bits(np.array([], np.int64)) == 0.0 and entropy_bits(np.zeros(3, np.int64)) == 0.0
    assert entropy_bits(np.array([3, 0, 1, 0])) == pytest.approx(3 * np.log2(4 / 3) + np.log2(4), rel=1e-12)
