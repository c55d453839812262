"""Wire format v6: records handed to the codec as torch tensors, coded where they are as
one prefix-coded bit stream (`gaps_prefix` / `symbols_prefix`, nemo_dcr.wire.prefix), and
what their decoder refuses. The coder is the same torch code on a CPU and a GPU; the
last test compares the two where a GPU is present."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
import torch

from nemo_dcr import dtypes, kernels
from nemo_dcr.errors import PayloadRejected
from nemo_dcr.records import Op, Payload, Record
from nemo_dcr.wire import prefix
from nemo_dcr.wire.codec import decode, encode
from nemo_dcr.wire.values import ValuesReader
from nemo_dcr.wire.varints import leb128_encode
from tests.test_codec import HDR, assert_same, edited, encodings, payload, reject, set_section, split, ulp_record

PREFIX = ("gaps_prefix", "symbols_prefix")


def as_tensors(r: Record, device: str = "cpu") -> Record:
    """The record with int64 positions and integer value bits as tensors on `device`."""
    width = dtypes.from_name(r.dtype).itemsize
    vals = np.ascontiguousarray(r.values).view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[width])
    return Record(r.name, r.dtype, r.shape, r.op, torch.from_numpy(r.positions.astype(np.int64)).to(device),
                  torch.from_numpy(vals.copy()).to(device))


def encode6(*recs: Record, device: str = "cpu") -> bytes:
    return encode(Payload(HDR, [as_tensors(r, device) for r in recs]), version=6)


def test_tensor_records_are_prefix_coded_and_decode_to_the_same_record():
    recs = [ulp_record("w", 300_000, 0.03), ulp_record("v", 300_000, 0.05, op=Op.ADD, seed=1),
            ulp_record("u", 1 << 20, 0.01, seed=2)]
    data = encode6(*recs)
    assert encodings(data) == [PREFIX] * 3
    assert_same(payload(*recs), decode(data))
    host = encode(payload(*recs))  # the joint rANS streams of the same records
    assert encodings(host) == [("gaps_joint", "symbols_joint")] * 3
    assert abs(len(data) - len(host)) < 0.01 * len(host)  # within a few tenths of a percent, either way


def edge_records() -> list[Record]:
    rng = np.random.default_rng(7)
    out = []
    pos = np.arange(0, 20 * 5000, 20, dtype=np.uint64)  # every gap 19: one quotient symbol, no bits for it
    out.append(Record("lone_quotient", "BF16", (200_000,), Op.ADD, pos, np.ones(pos.size, np.uint16)))
    # A cluster, then a gap of 10**9 and another cluster: quotients past 254 escape.
    pos = np.concatenate([np.arange(3000), 10**9 + np.arange(0, 6000, 3)]).astype(np.uint64)
    out.append(Record("escaped_quotient", "BF16", (1 << 40,), Op.XOR, pos,
                      rng.integers(1, 4, pos.size).astype(np.uint16)))
    # Sparse over 2**62 elements: Rice shifts past 32 (low bits in two pieces).
    pos = np.unique(rng.integers(0, 1 << 62, 5000, dtype=np.int64)).astype(np.uint64)
    out.append(Record("wide_shift", "F16", (1 << 62,), Op.XOR, pos, rng.integers(1, 9, pos.size).astype(np.uint16)))
    # Shifts near 30, where the low bits still fit after one refill (or just do not).
    for bits in (43, 44, 45):
        pos = np.unique(rng.integers(0, 1 << bits, 5000, dtype=np.int64)).astype(np.uint64)
        out.append(Record(f"shift_near_30_{bits}", "BF16", (1 << bits,), Op.XOR, pos,
                          rng.integers(1, 300, pos.size).astype(np.uint16)))
    # 2000 distinct values that occur once each beside four frequent ones: the table keeps
    # the repeated ones and escapes the rest.
    vals = np.where(rng.random(20_000) < 0.9, rng.integers(1, 5, 20_000),
                    rng.permutation(np.arange(1000, 60000))[:20_000]).astype(np.uint16)
    pos = np.sort(rng.choice(1 << 20, 20_000, replace=False)).astype(np.uint64)
    out.append(Record("escaped_values", "BF16", (1 << 20,), Op.XOR, pos, vals))
    for m in (4097, 4098, 4099):  # changes that do not fill the four lanes evenly
        pos = np.sort(rng.choice(200_000, m, replace=False)).astype(np.uint64)
        out.append(Record(f"lanes_{m}", "BF16", (200_000,), Op.XOR, pos, rng.integers(1, 60, m).astype(np.uint16)))
    pos = np.sort(rng.choice(300_000, 9000, replace=False)).astype(np.uint64)
    out.append(Record("one_byte", "F8_E4M3", (300_000,), Op.XOR, pos, rng.integers(1, 256, 9000).astype(np.uint8)))
    return out


@pytest.mark.parametrize("r", edge_records(), ids=lambda r: r.name)
def test_prefix_stream_edge_cases(r):
    data = encode6(r)
    assert encodings(data) == [PREFIX]
    assert_same(payload(r), decode(data))


def test_records_the_prefix_coder_leaves_to_the_host():
    rng = np.random.default_rng(3)
    few = ulp_record("few", 100_000, 0.02)  # 2000 changes: below the joint/prefix threshold
    dense = ulp_record("dense", 50_000, 0.2, seed=1)  # one change in 5: dense may be smaller
    wide = ulp_record("wide", 200_000, 0.05, dtype="F32", seed=2)  # 4-byte values
    pos = np.sort(rng.choice(200_000, 10_000, replace=False)).astype(np.uint64)
    noisy = Record("noisy", "BF16", (200_000,), Op.XOR, pos, rng.permutation(65536)[:10_000].astype(np.uint16))
    recs = [few, dense, wide, noisy]
    data = encode6(*recs)
    assert PREFIX not in encodings(data)
    assert_same(payload(*recs), decode(data))
    # Tensors in a version 5 payload: copied to the host and coded as arrays are.
    big = ulp_record("big", 300_000, 0.03)
    v5 = encode(Payload(HDR, [as_tensors(big)]))
    assert encodings(v5) == [("gaps_joint", "symbols_joint")] and v5 == encode(payload(big))


def test_tensor_records_are_checked_like_arrays():
    big = ulp_record("big", 300_000, 0.03)
    t = as_tensors(big)
    swapped = torch.cat([t.positions[1:2], t.positions[:1], t.positions[2:]])
    cases = [
        (Record("big", "BF16", (300_000,), Op.XOR, swapped, t.values), "positions not strictly increasing"),
        (Record("big", "BF16", (1000,), Op.XOR, t.positions, t.values), "position"),
        (Record("big", "BF16", (300_000,), Op.XOR, t.positions, t.values[:-1]), "values for"),
        (Record("big", "BF16", (300_000,), Op.XOR, t.positions, t.values.to(torch.int32)), "value width/dtype"),
        (Record("big", "BF16", (300_000,), Op.XOR, t.positions.double(), t.values), "positions must be integers"),
        (Record("big", "BF16", (300_000,), Op.XOR, t.positions, big.values), "two tensors on one device"),
    ]
    for r, msg in cases:
        with pytest.raises(ValueError, match=msg):
            encode(Payload(HDR, [r]), version=6)


def test_prefix_encodings_need_version_6_and_each_other():
    data = encode6(ulp_record("big", 300_000, 0.03))
    reject(edited(lambda h, s: None, data, version=5), "position encoding 'gaps_prefix' needs format version 6")

    def values_alone(h, s):
        h["records"][0]["positions"]["encoding"] = "gaps_rans"
    reject(edited(values_alone, data, version=6),
           "'gaps_prefix' positions and 'symbols_prefix' values come together (got 'gaps_rans' / 'symbols_prefix')")


# -------------------------------------------------------------- hand-made sections


def v(*xs) -> bytes:
    return leb128_encode(np.array(xs, np.uint64)).tobytes()


def nibbles(*lengths) -> bytes:
    return prefix.pack_lengths(np.array(lengths, np.uint8))


def four_changes(psec: bytes, vsec: bytes, numel: int = 100) -> bytes:
    """A v6 payload of one BF16 record of 4 changes with these raw sections."""
    base = encode6(ulp_record("x", 300_000, 0.03))

    def edit(h, s):
        h["records"][0].update(count=4, shape=[numel])
        set_section(h, s, 0, "positions", psec)
        set_section(h, s, 0, "values", vsec)
    return edited(edit, base, version=6)


# One value (5), coded with no bits: its code is a lone symbol.
VALUES = v(1, 0) + (5).to_bytes(2, "little") + v(1) + nibbles(1)


def gaps(lanes: list[bytes], lengths=(1, 1), r: int = 0, lane_lengths=None, tail: bytes = b"") -> bytes:
    """A gaps_prefix section: Rice shift r, quotient code lengths, four lanes (one change each)."""
    sizes = [len(x) for x in lanes] if lane_lengths is None else lane_lengths
    return v(r, len(lengths)) + nibbles(*lengths) + v(*sizes) + b"".join(lanes) + tail


def test_a_hand_made_prefix_record_decodes():
    # Quotient codes "0" (gap 0) and "1" (gap 1); lanes: 0, 1, 0, 1 -> positions 0, 2, 3, 5.
    data = four_changes(gaps([b"\x00", b"\x80", b"\x00", b"\x80"]), VALUES)
    r = decode(data).records[0]
    assert r.positions.tolist() == [0, 2, 3, 5] and r.values.tolist() == [5, 5, 5, 5]


@pytest.mark.parametrize("psec, reason", [
    (gaps([b"\x00", b"\x01", b"\x00", b"\x00"]), "lane: non-zero padding or bytes after its last change"),
    (gaps([b"\x00", b"\x00\x00", b"\x00", b"\x00"]), "lane: non-zero padding or bytes after its last change"),
    (gaps([b"\x00", b"", b"\x00", b"\x00"]), "lane ends inside a change"),
    (gaps([b"\x00"] * 4, lane_lengths=[1, 1, 1, 9]), "bit stream lanes of 12 bytes"),
    (gaps([b"\x00", b"\xc0", b"\x00", b"\x00"], lengths=(1, 2)), "unknown code"),  # "11": no code
    (gaps([b"\x00"] * 4, lengths=(1, 14)), "14 bits, more than 13"),
    (gaps([b"\x00"] * 4, lengths=(1, 1, 1)), "Kraft sum above 1"),
    (gaps([b"\x00"] * 4, lengths=(2,)), "a lone symbol must have length 1"),
    (gaps([b"\x00"] * 4, lengths=(1, 0)), "last symbol is absent"),
    (gaps([b"\x00"] * 4, lengths=(1, 1, 0)), "last symbol is absent"),
    (gaps([b"\x00"] * 4, tail=b"\x07"), "gaps section"),
    (gaps([b"\x00", b"\x00", b"\x00", b"\xc0"], lengths=(1, 2, 2), r=0), "position >= numel 5"),
])
def test_bad_prefix_positions_are_rejected(psec, reason):
    numel = 5 if "numel" in reason else 100
    e = reject(four_changes(psec, VALUES, numel), reason)
    assert "record 'x' positions" in e.reason


@pytest.mark.parametrize("vsec, reason", [
    (v(1, 0) + (5).to_bytes(2, "little") + v(2) + nibbles(1, 1), "symbols alphabet"),
    (v(1, 0) + (5).to_bytes(2, "little") + v(1) + nibbles(3), "a lone symbol must have length 1"),
    (v(1, 0) + (5).to_bytes(2, "little") + v(1) + nibbles(1) + b"\x00", "symbols section"),
])
def test_bad_prefix_values_are_rejected(vsec, reason):
    e = reject(four_changes(gaps([b"\x00"] * 4), vsec), reason)
    assert "record 'x' values" in e.reason


def test_corrupted_prefix_sections_only_reject():
    """Bit flips in a real prefix-coded record (resealed, so that the checksum passes):
    a rejection or a record, never another error."""
    data = encode6(ulp_record("x", 100_000, 0.05))
    _, h, secs = split(data)
    rng = np.random.default_rng(0)
    for _ in range(200):
        part = "positions" if rng.random() < 0.8 else "values"
        raw = bytearray(secs[0][part])
        raw[rng.integers(len(raw))] ^= 1 << int(rng.integers(8))

        def edit(hh, ss, raw=bytes(raw), part=part):
            set_section(hh, ss, 0, part, raw)
        try:
            decode(edited(edit, data, version=6))
        except PayloadRejected:
            pass


# -------------------------------------------------------------- codes


def huffman_bits(counts) -> int:
    """Total bits of an optimal prefix code: the sum of Huffman's merges."""
    heap = [int(c) for c in counts if c]
    heapq.heapify(heap)
    total = 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        total += a + b
        heapq.heappush(heap, a + b)
    return total


@pytest.mark.parametrize("seed", range(20))
def test_code_lengths_are_optimal_prefix_codes(seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 1000, int(rng.integers(2, 300))) * (rng.random(1) < 0.5)
    counts = np.where(rng.random(counts.size) < 0.3, 0, rng.geometric(0.05, counts.size))
    counts[-1] = max(counts[-1], 1)
    counts[0] = max(counts[0], 1)
    lengths = prefix.code_lengths(counts)
    assert ((lengths > 0) == (counts > 0)).all()
    assert int((lengths.astype(np.int64) * counts).sum()) == huffman_bits(counts)
    table, bits = prefix.decode_table(lengths)
    codes = prefix.canonical_codes(lengths)
    for s in np.flatnonzero(lengths):  # each code's slot decodes to its symbol: prefix-free
        k = int(lengths[s])
        assert table[int(codes[s]) << (bits - k)] == (s << 4) | k


def test_code_lengths_are_limited():
    counts = np.array([1, 1] + [int(1.7 ** k) for k in range(2, 40)])  # Huffman would go 39 deep
    lengths = prefix.code_lengths(counts)
    assert lengths.max() == prefix.MAX_CODE_BITS
    assert int((1 << (prefix.MAX_CODE_BITS - lengths.astype(np.int64))).sum()) <= 1 << prefix.MAX_CODE_BITS
    assert prefix.code_lengths(np.array([0, 0, 9])).tolist() == [0, 0, 1]  # a lone symbol
    with pytest.raises(ValueError, match="no symbol occurs"):
        prefix.code_lengths(np.zeros(3))


def test_split_kernel_runs_as_python_too():
    """The kernels' Python fallback (NEMO_DCR_NO_NUMBA=1) gives what the compiled one does."""
    r = ulp_record("x", 100_000, 0.05)
    _, h, secs = split(encode6(r))
    assert h["records"][0]["positions"]["encoding"] == "gaps_prefix"
    g = prefix.PrefixGaps(secs[0]["positions"], len(r.positions))
    vr = ValuesReader(secs[0]["values"], len(r.positions), dtypes.from_name("BF16"), "x", coding="prefix")
    out = []
    for split_kernel, join in ((kernels.prefix.prefix_split, kernels.gaps.gaps_join),
                               (kernels.prefix.prefix_split.py_func, kernels.gaps.gaps_join.py_func)):
        m = len(r.positions)
        qsym, vsym, gps = np.empty(m, np.uint8), np.empty(m, np.int16), np.empty(m, np.int64)
        assert split_kernel(g.buf, g.starts, g.ends, g.shift, *prefix.decode_table(g.lengths),
                            *prefix.decode_table(vr.model), qsym, gps, vsym) == 0
        assert join(qsym, -1, g.shift, np.empty(0, np.uint8), np.empty(0, np.int64), 100_000 - 1, gps, False) == 0
        out.append((qsym, vsym, gps))
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(out[0][2], r.positions.astype(np.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_codes_the_same_bytes_as_the_cpu():
    recs = [ulp_record("w", 1 << 22, 0.03), ulp_record("v", 1 << 21, 0.05, op=Op.ADD, seed=1), *edge_records()]
    on_gpu = encode6(*recs, device="cuda")
    assert on_gpu == encode6(*recs)
    assert_same(payload(*recs), decode(on_gpu))
