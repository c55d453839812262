"""Compiled single-pass kernels for the trainer hot path and the rANS coder of the wire format
(v5's streams and joint stream; v6's prefix-stream decoder).

Everything here is plain Python over numpy arrays, written so that numba can compile it
(`numba.njit`). With numba installed (a dependency, see pyproject.toml) the kernels run
compiled; without it, or with NEMO_DCR_NO_NUMBA=1, the very same functions run as
Python. Callers pick a vectorised numpy path instead where one exists (the diff, the
placement); the entropy coder has none, so without numba it runs these functions as
Python (correct and bit-identical, but ~100x slower). Either way the output bits are the
same: the code is the same.

Kernels never raise on bad input: decoders return a negative status and the caller
turns it into `PositionsError` (so `PayloadRejected`). Numba does not bounds-check array
accesses, so every index a decoder derives from input data is checked explicitly.

The rANS coder (docs/wire-format.md, "rANS streams"): two interleaved 32-bit states
kept in [2**16, 2**32), 16-bit renormalisation words, probabilities quantised to 2**16.
The encoder divides by a reciprocal multiply (exact, see `_rans_tables`) and can code a
record's two streams (positions and values, the same length) in one pass
(`rans_encode2`); the words are those of `rans_encode`, stream by stream.

A few operations numba has no spelling for - 512-bit compares and compress-stores for
the 16-bit diff (`diff16`), the high half of a 64 x 64-bit product for the coder, a
cache prefetch for the streaming kernels (`_prefetch`, a no-op in Python) - are
LLVM intrinsics (bottom of this file) standing in for plain Python functions of the same
name, so the Python fallback computes the same thing. `diff16` needs AVX-512 (VBMI2) and
is only called when the host has it (`HAVE_VECTOR_DIFF`); elsewhere `diff16_bitscan`
(the same compares, and a bit scan of their masks instead of compresses) gives the same
arrays.
"""

from __future__ import annotations

import os

import numpy as np

try:
    if os.environ.get("NEMO_DCR_NO_NUMBA") == "1":
        raise ImportError("disabled by NEMO_DCR_NO_NUMBA=1")
    import numba as _numba
except ImportError:  # pragma: no cover - exercised by the fallback tests through .py_func
    _numba = None

HAVE_NUMBA = _numba is not None

PROB_BITS = 16
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 16  # lower bound of the state; also the state the encoder starts from


def _jit(f):
    if _numba is None:
        f.py_func = f  # same attribute as a numba dispatcher: the pure-Python function
        return f
    return _numba.njit(cache=True, nogil=True)(f)


def _jit_inline(f):
    """_jit for a helper of a hot loop, inlined by numba into its callers (so that the
    callers' scalars stay in registers across calls)."""
    if _numba is None:
        f.py_func = f
        return f
    return _numba.njit(cache=True, nogil=True, inline="always")(f)


# The project's compiled-kernel decorators, for kernels kept in the modules they serve.
jit, jit_inline = _jit, _jit_inline



# ======================================================================== diff


@_jit
def diff_words(a, b, aw, bw, per, w0, pos, new, old, n0):
    """Scan int64 words aw/bw (views of a/b) from word w0; write every element of a word
    that differs into (pos, new, old) from slot n0, keeping only the changed ones.

    In blocks of 32 words: an OR over the block's xors (no branch per word) skips clean
    blocks; in a block that differs, the indices of differing words are compacted
    branch-free, then their elements are written with the slot advanced by the element
    compare. Index arithmetic is unsigned (no negative-index handling in the loops).
    Returns (n, w): the slots used and the next word to scan (< len(aw) when the
    output buffers were full; call again with larger buffers)."""
    nw = np.uint64(aw.size)
    cap = np.uint64(pos.size)
    uper = np.uint64(per)
    n = np.uint64(n0)
    idx = np.empty(32, np.uint64)
    w = np.uint64(w0)
    while w < nw:
        end = w + np.uint64(32)
        if end > nw:
            end = nw
        nb = end - w
        acc = np.int64(0)
        if nb == np.uint64(32):
            for k in range(32):  # fixed trip count: vectorised
                acc |= aw[w + np.uint64(k)] ^ bw[w + np.uint64(k)]
        else:
            for k in range(nb):
                acc |= aw[w + np.uint64(k)] ^ bw[w + np.uint64(k)]
        if acc != 0:
            if n + nb * uper > cap:
                return np.int64(n), np.int64(w)
            nd = np.uint64(0)
            for k in range(nb):
                idx[nd] = w + np.uint64(k)
                nd += np.uint64(aw[w + np.uint64(k)] != bw[w + np.uint64(k)])
            for d in range(nd):
                e = idx[d] * uper
                for j in range(uper):
                    x = a[e + j]
                    y = b[e + j]
                    pos[n] = np.int64(e + j)
                    new[n] = x
                    old[n] = y
                    n += np.uint64(x != y)
        w = end
    return np.int64(n), np.int64(nw)


# Values a 16-bit diff can write beside the new bits: DIFF_OLD (committed bits),
# DIFF_XOR (new ^ old), DIFF_ADD (new - old, wrapping), DIFF_NONE (only positions and new bits).
DIFF_OLD, DIFF_XOR, DIFF_ADD, DIFF_NONE = 0, 1, 2, 3
DIFF_BLOCK = 128  # elements per block of `diff16`
_LANES = 32  # 16-bit elements per 512-bit vector
# The 16-bit scans prefetch both inputs this many elements (4 KiB) ahead of the block they
# compare: without it the compress work of a block that differs stalls the next blocks'
# loads. On an Emerald Rapids core (64M elements, best of 11 alternating runs) `diff16` took
# 19.7-21.4 ms instead of 23.3-25.8 at 1-5% changes, no change at 0%; 1024-4096 elements
# ahead measured alike, non-temporal hints 30-150% slower (BENCHMARKS.md).
DIFF_PREFETCH = 2048
# `diff16`'s rows when positions take no row skips: (row_end, row_len, row_skip). Passed
# explicitly: numba's specialisation for omitted default arguments ran the scan 7-10% slower.
NO_ROWS = (1 << 62, 1, 0)


def _value_py(x, y, kind):
    if kind == "old":
        return y
    if kind == "xor":
        return x ^ y
    return x - y  # numpy arrays wrap around


def _vmask32(a, b, i):
    """Bit k set where a[i + k] != b[i + k], k < 32."""
    return int(np.packbits(a[i:i + _LANES] != b[i:i + _LANES], bitorder="little").view("<u4")[0])


def _eq_mask(a, i, s):
    """Bit k set where a[i + k] == s, over the 512 bits from a[i]: 64 bytes of a uint8 array,
    32 elements of a 16-bit one (compiled: one vector compare)."""
    lanes = 64 // a.itemsize
    return int(np.packbits(a[i:i + lanes] == s, bitorder="little").view(f"<u{lanes // 8}")[0])


def _ge_mask(a, i, s):
    """`_eq_mask` for a[i + k] >= s."""
    lanes = 64 // a.itemsize
    return int(np.packbits(a[i:i + lanes] >= s, bitorder="little").view(f"<u{lanes // 8}")[0])


def _popcount(x):
    """Set bits of a uint64 (compiled: one `popcnt`)."""
    return int(x).bit_count()


def _store_be64(a, at, x):
    """a[at:at + 8] = the eight bytes of the uint64 x, most significant first (compiled: a
    byte swap and one unaligned store). Callers keep at + 8 <= a.size."""
    a[at:at + 8] = np.frombuffer(int(x).to_bytes(8, "big"), np.uint8)


def _be64(b, at):
    """Bytes at..at+7 of the uint8 array b as a big-endian uint64 (compiled: one unaligned
    load and a byte swap where b is contiguous). Callers keep at + 8 <= b.size."""
    w = np.uint64(0)
    for k in range(8):
        w = (w << np.uint64(8)) | np.uint64(b[at + k])
    return w


def _prefetch(a, i):
    """Hint the cache line holding a[i] into the cache (compiled: one `prefetcht0`; no-op in
    Python). Never faults, so it needs no bounds, but callers keep i inside a."""


@_jit_inline
def _prefetch_block(a, b, i):
    """Prefetch the DIFF_BLOCK elements of a and b from element i: 4 lines of BF16 each."""
    for k in range(0, DIFF_BLOCK, _LANES):
        _prefetch(a, i + k)
        _prefetch(b, i + k)


def _vstep_py(a, b, i, base, pos, new, v, n, kind):
    x = a[i:i + _LANES]
    y = b[i:i + _LANES]
    hit = np.flatnonzero(x != y)
    m = n + hit.size
    pos[n:m] = hit + (base + i)
    new[n:m] = x[hit]
    if kind:
        v[n:m] = _value_py(x[hit], y[hit], kind)
    return m


def _vstep_old(a, b, i, mask, base, pos, new, v, n):
    return _vstep_py(a, b, i, base, pos, new, v, n, "old")


def _vstep_xor(a, b, i, mask, base, pos, new, v, n):
    return _vstep_py(a, b, i, base, pos, new, v, n, "xor")


def _vstep_add(a, b, i, mask, base, pos, new, v, n):
    return _vstep_py(a, b, i, base, pos, new, v, n, "add")


def _vstep_none(a, b, i, mask, base, pos, new, v, n):
    return _vstep_py(a, b, i, base, pos, new, v, n, "")


@_jit
def _row_base(i, base, row_end, row_len, row_skip):
    """(base plus the skips of the rows that end at or before element i, the end of the
    row holding i): see `diff16`'s rows."""
    if i < row_end:
        return base, row_end
    k = (i - row_end) // row_len + 1
    return base + k * row_skip, row_end + k * row_len


@_jit
def diff16(a, b, i0, base, pos, new, v, mode, n0, row_end, row_len, row_skip):
    """Diff of 16-bit arrays a (new) / b (committed) in blocks of 128 elements, from element
    i0 (a multiple of 128) up to the last whole block; the caller diffs the tail.

    For every element that differs, in order, writes base + index (plus the rows' skips,
    below) into `pos` (int64, or int32 when every such position is below 2**31), its new
    bits into `new` and, by `mode` (DIFF_*),
    its committed bits, xor or wrapping difference into v (an array of a's dtype; empty
    for DIFF_NONE), from slot n0. Slots past the last one written may be
    overwritten too (up to a block beyond it): the buffers need DIFF_BLOCK slots of room.

    Compiled, a block costs four 32-lane compares (512-bit loads of both inputs) and one
    branch; a block that differs anywhere is written 32 elements at a time with AVX-512
    (VBMI2) compresses into a register and one full-width store each, with no branch per
    element or word: a few instructions per 32 elements whatever the change rate. Both
    inputs are prefetched DIFF_PREFETCH elements ahead, so that the compresses do not hold
    up the next blocks' loads. Returns
    (n, i): the slots used and the next element to scan (< the last whole block when the
    buffers were full; call again with larger buffers).

    Rows (`row_end`, `row_len`, `row_skip`; multiples of DIFF_BLOCK but the skip): the
    positions of elements from `row_end` on are `row_skip` larger, and another `row_skip`
    for every `row_len` elements after it, so that a block of a canonical tensor's rows
    (a row-parallel weight's shard) gets its canonical positions here, with no placement
    pass after the diff. One compare a block."""
    cap = pos.size
    n = n0
    i = i0
    stop = a.size - a.size % DIFF_BLOCK
    ahead = stop - DIFF_PREFETCH  # blocks before this one prefetch the block DIFF_PREFETCH on
    rb, nxt = _row_base(i, base, row_end, row_len, row_skip)
    while i < stop:
        if n + DIFF_BLOCK > cap:
            return n, i
        if i >= nxt:  # a block never straddles a row's end
            rb += row_skip
            nxt += row_len
        if i < ahead:
            _prefetch_block(a, b, i + DIFF_PREFETCH)
        # One 32-lane compare mask per quarter; a block that differs nowhere costs just that.
        masks = (_vmask32(a, b, i), _vmask32(a, b, i + _LANES), _vmask32(a, b, i + 2 * _LANES),
                 _vmask32(a, b, i + 3 * _LANES))
        if (masks[0] | masks[1]) | (masks[2] | masks[3]):
            for k in range(4):
                j = i + k * _LANES
                m = masks[k]
                if mode == DIFF_XOR:
                    n = _vstep_xor(a, b, j, m, rb, pos, new, v, n)
                elif mode == DIFF_ADD:
                    n = _vstep_add(a, b, j, m, rb, pos, new, v, n)
                elif mode == DIFF_OLD:
                    n = _vstep_old(a, b, j, m, rb, pos, new, v, n)
                else:
                    n = _vstep_none(a, b, j, m, rb, pos, new, v, n)
        i += DIFF_BLOCK
    return n, i


def _ctz64(m):
    """Trailing zero bits of a 64-bit mask, 64 for 0 (compiled: one `tzcnt`)."""
    m = int(m)
    return (m & -m).bit_length() - 1 if m else 64


def _drop_lowest(m):
    """The 64-bit mask m without its lowest set bit; 0 stays 0 (compiled: one `blsr`)."""
    m = int(m)
    return m & (m - 1) if m else 0


@_jit_inline
def _put_change(a, b, e, rb, pos, new, v, n, mode):
    """Slot n of `diff16`'s outputs for element e (rb: the position of element 0)."""
    x = a[e]
    y = b[e]
    pos[n] = rb + e
    new[n] = x
    if mode == DIFF_XOR:
        v[n] = x ^ y
    elif mode == DIFF_ADD:
        v[n] = x - y
    elif mode == DIFF_OLD:
        v[n] = y


@_jit
def diff16_bitscan(a, b, i0, base, pos, new, v, mode, n0, row_end, row_len, row_skip):
    """`diff16` for hosts without AVX-512 compress-stores (AVX2 and older): the same
    arguments (rows too), blocks, buffers' room and result, and the same arrays out.

    A block's four 32-lane compare masks are joined into two 64-bit words, and each word's
    set bits are walked with a trailing-zero count, two a step: a step writes two slots
    whatever is left (a word's last odd change, or a word without changes in a block that
    has some, also fills slots that the next change overwrites, the word's first element
    standing in for the missing one), so the walk of a word with one or two changes
    exits without looking at the mask again, and one with three or four after one more
    step. Measured on a Zen 3 core: walking one change a step (one exit per word, taken
    after a varying count), the diff took 1.07-1.18x as long at 3-5% (whole refits, 64M-160M
    elements), three or four a step no less than two; a walk per 32-lane mask took
    1.2-1.5x as long, the word scan `diff_words` 1.8-2.3x, and writing a fixed number of
    slots per mask more still. Prefetches as `diff16` does. Like `diff16`, it may write
    slots past the last change (up to two; the buffers' room covers them)."""
    cap = pos.size
    n = n0
    i = i0
    stop = a.size - a.size % DIFF_BLOCK
    ahead = stop - DIFF_PREFETCH
    rb, nxt = _row_base(i, base, row_end, row_len, row_skip)
    while i < stop:
        if n + DIFF_BLOCK > cap:
            return n, i
        if i >= nxt:
            rb += row_skip
            nxt += row_len
        if i < ahead:
            _prefetch_block(a, b, i + DIFF_PREFETCH)
        low = np.uint64(_vmask32(a, b, i)) | (np.uint64(_vmask32(a, b, i + _LANES)) << np.uint64(32))
        high = np.uint64(_vmask32(a, b, i + 2 * _LANES)) | (np.uint64(_vmask32(a, b, i + 3 * _LANES)) << np.uint64(32))
        if low | high:
            for half in range(2):
                m = low if half == 0 else high
                j = i + 2 * _LANES * half
                left = np.int64(_popcount(m))
                while True:  # two changes a step (docstring); tzcnt of 0 is 64, so & 63
                    _put_change(a, b, j + np.int64(_ctz64(m) & 63), rb, pos, new, v, n, mode)
                    m = _drop_lowest(m)
                    _put_change(a, b, j + np.int64(_ctz64(m) & 63), rb, pos, new, v, n + 1, mode)
                    m = _drop_lowest(m)
                    if left <= 2:
                        n += left
                        break
                    n += 2
                    left -= 2
        i += DIFF_BLOCK
    return n, i


def _host_has_vector_diff() -> bool:
    """Whether numba compiles for this host and the host has the AVX-512 compress-stores
    `diff16` is built on (elsewhere LLVM would emulate them element by element, and the
    16-bit diff takes `diff16_bitscan`). NEMO_DCR_NO_VECTOR_DIFF=1 turns it off."""
    if _numba is None or os.environ.get("NEMO_DCR_NO_VECTOR_DIFF") == "1":
        return False
    try:
        import llvmlite.binding as ll
        from numba.core import config

        if config.CPU_NAME not in (None, "host"):
            return False  # an explicit (e.g. portable) target: do not assume the host's features
        feats = ll.get_host_cpu_features()
        return all(feats.get(f, False) for f in ("avx512f", "avx512bw", "avx512vl", "avx512vbmi2"))
    except Exception:  # pragma: no cover - an llvmlite without the query
        return False


HAVE_VECTOR_DIFF = _host_has_vector_diff()


# ======================================================================== placement


_AFFINE_EXACT = 1 << 50  # affine_index's double-precision rows are exact below this offset
_AFFINE_NARROW = 1 << 31  # offsets below this take affine_index's multiply-shift rows


@_jit
def affine_index(local, local_start, cols, offset, row_stride, out):
    """out[i] = offset + r * row_stride + c, (r, c) = divmod(local[i] - local_start, cols).

    Offsets rel = local[i] - local_start in [0, 2**31), with row_stride >= cols (every
    monotone piece) and both below 2**31: the row is (rel * m) >> (31 + l), l = ceil(log2
    cols), m = ceil(2**(31 + l) / cols) < 2**32, exact for every 31-bit rel (Granlund and
    Montgomery's round-up method), and every multiply is 32 x 32 -> 64 bits, which the
    vectorised loop does eight to a 512-bit register (0.30-0.44 against 0.64-0.84 ns a
    position on an Emerald Rapids core, where the double-precision row below needed
    64-bit multiplies). Anything else, or an offset out of that range (checked on the
    way), takes `_affine_index_wide`: a call whose positions reach 2**31 past the piece's
    start (a piece of more than 2**31 elements) pays both loops; splitting the check into
    blocks cost the vectorised loop 4x and was not kept."""
    grow = row_stride - cols  # canonical = local - local_start + offset + row * grow
    if 1 <= cols < _AFFINE_NARROW and 0 <= grow < _AFFINE_NARROW:
        l = 0
        while (1 << l) < cols:
            l += 1
        m = np.uint64(((1 << (31 + l)) + cols - 1) // cols)
        shift = np.uint64(31 + l)
        g = np.uint64(grow)
        wide = False
        for i in range(local.size):
            rel = np.int64(local[i]) - local_start
            wide |= (rel < 0) | (rel >= _AFFINE_NARROW)
            row = (np.uint64(rel & 0x7FFFFFFF) * m) >> shift  # < 2**31: the mask only tells the vectoriser
            out[i] = rel + offset + np.int64(np.uint64(row & 0x7FFFFFFF) * g)
        if not wide:
            return
    _affine_index_wide(local, local_start, cols, offset, row_stride, out)


@_jit
def _affine_index_wide(local, local_start, cols, offset, row_stride, out):
    """`affine_index` for any offsets: the row from a multiply by 1 / cols in double
    precision, set right by one step either way, exact while |rel| < 2**50 (else the
    integer division below); no division or branch per element, so the loop is
    vectorised too."""
    inv = 1.0 / cols
    grow = row_stride - cols
    base = offset - local_start
    far = False
    for i in range(local.size):
        rel = local[i] - local_start
        row = np.int64(rel * inv)
        row += np.int64((row + 1) * cols <= rel)
        row -= np.int64(row * cols > rel)
        far |= (rel >= _AFFINE_EXACT) | (rel <= -_AFFINE_EXACT)
        out[i] = local[i] + base + row * grow
    if far:
        for i in range(local.size):
            rel = local[i] - local_start
            out[i] = local[i] + base + (rel // cols) * grow


@_jit
def strictly_increasing_below(p, max_pos):
    """0 if int64 (or uint32) positions p are >= 0, strictly increasing and <= max_pos; else 1 + index
    of the first offender (with -1 meaning p[-1] > max_pos)."""
    n = p.size
    if n == 0:
        return 0
    bad = p[0] < 0
    for i in range(1, n):  # no early exit: vectorised
        bad |= p[i] <= p[i - 1]
    if not bad and p[n - 1] <= max_pos:
        return 0
    prev = -1
    for i in range(n):
        v = p[i]
        if v <= prev:
            return i + 1
        prev = v
    return -1


@_jit_inline
def _put_varint(out, n, v):
    """The unsigned LEB128 of the uint64 v into out from n; returns the next free index."""
    top = np.uint64(0x80)
    while v >= top:
        out[n] = np.uint8((v & np.uint64(0x7F)) | top)
        v = v >> np.uint64(7)
        n += 1
    out[n] = np.uint8(v)
    return n + 1


@_jit
def leb128(x, out):
    """Unsigned LEB128 of every uint64 of x into out (room for 10 bytes each); returns
    the bytes written (the same bytes as positions.leb128_encode)."""
    n = 0
    for i in range(x.size):
        n = _put_varint(out, n, np.uint64(x[i]))
    return n


@_jit
def runs_leb128(p, out):
    """`positions.encode_runs`' varints for strictly increasing uint64 (or uint32)
    positions p: for each run of consecutive positions, the gap from the end of the run
    before it (from 0 for the first), then its length; into out (room for 20 bytes a
    position). Returns the bytes written. One pass where numpy's ten steps took ~20 us
    for a record of a few changes, the records for which runs are always tried."""
    n = 0
    i = 0
    end = np.uint64(0)  # one past the previous run
    one = np.uint64(1)
    while i < p.size:
        start = np.uint64(p[i])
        j = i + 1
        while j < p.size and np.uint64(p[j]) == np.uint64(p[j - 1]) + one:
            j += 1
        n = _put_varint(out, n, start - end)
        n = _put_varint(out, n, np.uint64(j - i))
        end = np.uint64(p[j - 1]) + one
        i = j
    return n


@_jit
def leb128_parse(buf, start, n, out):
    """Decode up to n canonical unsigned LEB128 varints from buf[start:] into uint64 out
    (size >= n); stops at n or at the end of buf. Returns (varints decoded, end offset),
    or (-1, offset of the bad varint) for one that is truncated, longer than 10 bytes,
    non-minimal or beyond 64 bits (positions.leb128_decode names the reason)."""
    p = start
    k = 0
    size = buf.size
    while k < n and p < size:
        v = np.uint64(0)
        length = 0
        while True:
            if p + length >= size or length >= 10:
                return -1, p
            b = buf[p + length]
            v |= np.uint64(b & 0x7F) << np.uint64(7 * length)
            length += 1
            if b < 0x80:
                break
        if length > 1 and b == 0:
            return -1, p
        if length == 10 and b > 1:
            return -1, p
        out[k] = v
        k += 1
        p += length
    return k, p


@_jit
def model_parse(buf, start, max_alphabet, total, out):
    """A stream's model at buf[start:] as `positions.read_model` reads it, in one compiled
    call where its varint reads and numpy checks took ~12 us a model, two models a joint
    record: the alphabet size, then that many frequencies into uint64 out, all canonical
    varints, 1 <= alphabet <= min(max_alphabet, out.size), every frequency <= total and
    their sum == total. Returns (alphabet, end offset), or (0, start) for anything else:
    the caller's checked path then names what is wrong."""
    k, end = leb128_parse(buf, start, 1, out)
    if k != 1 or out[0] < 1 or out[0] > max_alphabet or out[0] > out.size:
        return 0, start
    alphabet = np.int64(out[0])
    k, end = leb128_parse(buf, end, alphabet, out)
    if k != alphabet:
        return 0, start
    s = np.uint64(0)
    for i in range(alphabet):
        if out[i] > np.uint64(total):
            return 0, start
        s += out[i]
    if s != np.uint64(total):
        return 0, start
    return alphabet, end


# ======================================================================== gaps


_RICE_BLOCKS, _RICE_RUN = 64, 64  # rice_shift's sample of a long record: 2**12 gaps
_INT64_MAX = (1 << 63) - 1


@_jit
def rice_shift(p, cap):
    """Rice shift r for the sorted int64 positions p (0 when empty), quotient symbols capped at
    `cap`: the best of three shifts around log2(mean gap) by estimated size (order-0
    entropy of the capped quotients + r raw bits per gap + 24 bits per escape), on at most
    2**13 gaps: all of them (g_0 = p[0]) below 2**13 positions, else _RICE_BLOCKS runs of
    _RICE_RUN consecutive gaps evenly spread (runs, not single gaps: each takes a few cache
    lines where lone gaps missed the cache every time, ~0.4 ms a payload). With 2**12 sampled
    gaps instead of 2**14 the payloads of benchmarks/trainer_speed.py and codec.py came out
    -0.14% to +0.02% a row, at 7 us a record against 24. Negative
    gaps (unsorted input, which the split then rejects) count as 0. The choice only affects
    the size, never correctness. One pass for the mean, one for a histogram of the
    quotients by the smallest shift (those by the two larger shifts are sums of its bins)."""
    n = p.size
    if n == 0:
        return 0
    if n < 2 * _RICE_BLOCKS * _RICE_RUN:
        k = n
        g = np.empty(k, np.int64)
        for j in range(k):
            g[j] = max(np.int64(p[j]) - (np.int64(p[j - 1]) if j else -1) - 1, 0)
    else:
        k = _RICE_BLOCKS * _RICE_RUN
        g = np.empty(k, np.int64)
        stride = (n - 1 - _RICE_RUN) // (_RICE_BLOCKS - 1)  # >= _RICE_RUN: the runs do not overlap
        for b in range(_RICE_BLOCKS):
            at = 1 + b * stride
            for j in range(_RICE_RUN):
                g[b * _RICE_RUN + j] = max(np.int64(p[at + j]) - np.int64(p[at + j - 1]) - 1, 0)
    total = 0
    for j in range(k):
        total += g[j]
    base = rice_base(total, k)
    if base < 0:
        return 0
    top = 4 * cap + 3
    h0 = np.zeros(top + 1, np.int64)
    for j in range(k):
        h0[min(g[j] >> base, top)] += 1
    return rice_pick(h0, base, k, cap)


@_jit
def rice_base(total, k):
    """The smallest shift `rice_pick` weighs for k gaps summing to `total`: two below
    log2 of their mean; -1 when the mean is below 2 (the shift is then 0)."""
    mean = total / k
    if mean < 2.0:
        return -1
    return max(0, int(np.floor(np.log2(mean))) - 2)


@_jit
def rice_pick(h0, base, k, cap):
    """Of shifts base, base + 1, base + 2, the one whose capped quotients cost the fewest
    estimated bits (see rice_shift), given h0: the histogram of min(g >> base, 4 * cap + 3)
    over k gaps."""
    top = 4 * cap + 3
    below = np.zeros(top + 2, np.int64)  # below[b]: quotients by base in bins < b
    for b in range(top + 1):
        below[b + 1] = below[b] + h0[b]
    log_k = np.log2(k)
    best = np.inf
    best_r = base
    for d in range(3):
        w = 1 << d
        bits = 0.0
        esc = 0
        for sym in range(cap + 1):  # quotients by base + d: symbol min(q >> d, cap) of bin q
            c = below[(sym + 1) * w if sym < cap else top + 1] - below[sym * w]
            if c:
                bits += c * (log_k - np.log2(c))
            esc = c
        size = bits + k * (base + d) + 24 * esc
        if size < best:
            best, best_r = size, base + d
    return best_r


@_jit
def gaps_split(p, r, esc, sym, counts, low, excess, lows):
    """Gaps of sorted int64 (or uint32) positions, split by the Rice shift r.

    sym[i] = min(g_i >> r, esc), counts[s] += 1, the r low bits of every gap packed MSB
    first into `low` (zero-padded to a byte), excess[k] = (g >> r) - esc for the k-th
    escaped gap. Returns (low bytes written, escapes, gaps equal to 0 after the first,
    0), or (0, 0, 0, 1 + i) when position i is negative or not above the one before it
    (the first such i): the split checks the order on the way, so callers need no
    separate pass over the positions. On that error `sym` may hold symbols already.
    `lows` is scratch for the low bits one a byte: ceil(n / 8) * 8 bytes when 1 <= r <= 8
    (whole uint64 words; the caller's, so that a warm buffer can be reused), else unused.

    Three passes, each ~0.3-0.6 ns a gap, where one loop doing all of it took 1.6: the
    symbols, order check and counts of zero and escaped gaps (no state carried from gap to
    gap: the loop vectorises), and for shifts of 1-8 each gap's low bits as a byte; the
    symbols' counts (`_count_symbols`: 64 at a time by byte compares); the low bits packed
    (`_pack_low_bytes` from those bytes, eight gaps a step, else `_pack_low_bits` from the
    positions): 1.0-1.2 ns a gap in all on an Emerald Rapids core, where the same passes
    counting one symbol and packing one gap at a time took 1.6-1.7. The escapes' excesses
    (`_excesses`) and the first bad position (an error: `strictly_increasing_below`) take a
    pass of their own when there are any."""
    n = p.size
    if n == 0:
        return 0, 0, 0, 0
    as_bytes = 1 <= r <= 8
    lowmask = (1 << r) - 1
    first = np.int64(p[0])  # g_0 = p[0]: the gap from position -1
    neg = first < 0
    zeros = 0
    escapes = np.int64((first >> r) >= esc)
    sym[0] = min(first >> r, esc)
    if as_bytes:
        lows[0] = first & lowmask
    for i in range(1, n):
        g = np.int64(p[i]) - np.int64(p[i - 1]) - 1  # uint32 positions too: gaps in int64
        q = g >> r
        neg |= g < 0
        zeros += g == 0
        escapes += q >= esc
        sym[i] = min(q, esc)
        if as_bytes:  # loop-invariant: the compiled loop is split in two, neither branches
            lows[i] = g & lowmask
    if neg:  # name the first offender
        return 0, 0, 0, strictly_increasing_below(p, _INT64_MAX)
    if escapes:
        _excesses(p, r, esc, sym, excess)
    _count_symbols(sym, n, counts)
    nb = _pack_low_bytes(lows, n, r, low) if as_bytes else _pack_low_bits(p, r, low)
    return nb, escapes, zeros, 0


@_jit
def _excesses(p, r, esc, sym, excess):
    """excess[k] = (g >> r) - esc for the k-th gap of p whose symbol is esc, in order.

    Escapes are rare but not absent (a row-parallel piece's rows leave a gap of a whole
    row between them): the symbols are tested 8 at a time, through a uint64 view, for a
    byte equal to esc, and only words holding one are looked at byte by byte. A pass over
    every gap again took ~0.45 ns a gap, a quarter of the split."""
    n = p.size
    words = sym[:n - n % 8].view(np.uint64)
    seven = np.uint64(0x7F7F7F7F7F7F7F7F)
    every = np.uint64(0xFFFFFFFFFFFFFFFF)
    pattern = np.uint64(esc) * np.uint64(0x0101010101010101)
    ne = 0
    for w in range(words.size):
        x = words[w] ^ pattern  # zero bytes where the symbol is esc
        if ((x & seven) + seven) | x | seven != every:  # bit 7 of a byte is clear iff that byte of x is 0
            ne = _excesses_in(p, r, esc, sym, excess, 8 * w, 8 * w + 8, ne)
    _excesses_in(p, r, esc, sym, excess, 8 * words.size, n, ne)


@_jit
def _excesses_in(p, r, esc, sym, excess, lo, hi, ne):
    """`_excesses` of the gaps lo..hi-1, from excess[ne]: the next free slot."""
    for i in range(lo, hi):
        if sym[i] == esc:
            excess[ne] = ((np.int64(p[i]) - (np.int64(p[i - 1]) if i else -1) - 1) >> r) - esc
            ne += 1
    return ne


_SMALL_SYMBOLS = 16  # _count_symbols counts the symbols below this 64 at a time


@_jit
def _count_symbols(sym, n, counts):
    """counts[s] += the occurrences of s in the uint8 symbols sym[:n] (each < counts.size).

    Symbols below _SMALL_SYMBOLS, nearly all of a Rice split's quotients (99.4% of them in
    `trainer_speed.py`'s refits at 5%, 97% at 1%), are counted 64 at a time, one byte
    compare and popcount per symbol value (`_eq_mask`); the others, which one more
    compare finds (`_ge_mask`), one at a time, as are the last n % 64 (and every symbol of a
    strided array, which the 64-byte compares cannot read)."""
    small = np.zeros(_SMALL_SYMBOLS, np.int64)
    one = np.uint64(1)
    blocks = n // 64 if sym.strides[0] == 1 else 0  # the compares read 64 bytes at once
    for b in range(blocks):
        i = 64 * b
        for s in range(_SMALL_SYMBOLS):
            small[s] += _popcount(_eq_mask(sym, i, s))
        m = np.uint64(_ge_mask(sym, i, _SMALL_SYMBOLS))
        while m:
            counts[sym[i + np.int64(_ctz64(m))]] += 1
            m &= m - one
    for s in range(min(_SMALL_SYMBOLS, counts.size)):
        counts[s] += small[s]
    for i in range(64 * blocks, n):
        counts[sym[i]] += 1


_BYTES = np.uint64(0x00FF00FF00FF00FF)  # _pack_low_bytes' lane masks: bytes, 16-bit halves
_HALVES = np.uint64(0x0000FFFF0000FFFF)
_WORD = np.uint64(0xFFFFFFFF)


@_jit
def _pack_low_bytes(lows, n, r, low):
    """`_pack_low_bits` for 1 <= r <= 8, from the n gaps' low bits given one a byte (lows,
    whole uint64 words of them): eight gaps make exactly r bytes, so a step merges one word
    of eight in three shift-and-or rounds (byte pairs into 2r bits, those into 4r, into
    8r, the first gap's bits highest) and stores them with one unaligned 8-byte store
    (`_store_be64`; the next step overwrites the 8 - r bytes past them). No bits are
    carried from step to step. 0.25-0.6 against 0.7-1.0 ns a gap for the positions' loop
    (r = 1-8, Emerald Rapids). The last steps, whose store would pass the end of `low`,
    and the last n % 8 gaps take the bit loop. Returns the bytes written."""
    words = lows.view(np.uint64)
    ur = np.uint64(r)
    head = np.uint64(64 - 8 * r)
    nb = 0
    w = 0
    full = n // 8 if low.strides[0] == 1 else 0  # the stores write 8 bytes at once
    while w < full and nb + 8 <= low.size:
        x = words[w]  # gap 8w + k in byte k
        x = ((x & _BYTES) << ur) | ((x >> np.uint64(8)) & _BYTES)
        x = ((x & _HALVES) << (ur + ur)) | ((x >> np.uint64(16)) & _HALVES)
        x = ((x & _WORD) << (ur * np.uint64(4))) | (x >> np.uint64(32))
        _store_be64(low, nb, x << head)
        nb += r
        w += 1
    acc = 0
    nbits = 0
    for i in range(8 * w, n):
        nb, acc, nbits = _append_bits(low, nb, acc, nbits, np.int64(lows[i]), r)
    return _flush_bits(low, nb, acc, nbits)


@_jit_inline
def _append_bits(low, nb, acc, nbits, bits, width):
    """Append `width` <= 48 bits to the pending acc (nbits < 8 of them), the whole bytes to
    low[nb:]: (nb, acc, nbits) after."""
    acc = (acc << width) | bits
    nbits += width
    while nbits >= 8:
        nbits -= 8
        low[nb] = (acc >> nbits) & 0xFF
        nb += 1
    return nb, acc & ((1 << nbits) - 1), nbits


@_jit_inline
def _flush_bits(low, nb, acc, nbits):
    """The pending bits as a last byte, zero-padded: the bytes written."""
    if nbits:
        low[nb] = (acc << (8 - nbits)) & 0xFF
        nb += 1
    return nb


@_jit
def _pack_low_bits(p, r, low):
    """The r low bits of every gap of p (sorted), MSB first, into `low`, the last byte
    zero-padded: the bytes written. For r <= 32 the gaps go four at a step and the bits
    leave 32 at a time, as 4 bytes; the last n % 4 gaps, and every gap for r > 32, take
    the general loop, which writes whole bytes as they fill."""
    n = p.size
    nb = 0
    acc = 0  # pending bits: < 32 between steps of the first loop, < 8 in the second
    nbits = 0
    prev = -1
    i = 0
    lowmask = (1 << r) - 1
    m = n - n % 4 if r <= 32 else 0  # (no `if` around the loop: that ran ~12% slower)
    while i < m:
        for u in range(4):
            v = np.int64(p[i + u])
            acc = (acc << r) | ((v - prev - 1) & lowmask)  # < 32 bits pending, so < 64 after
            prev = v
            nbits += r
            if nbits >= 32:
                nbits -= 32
                w = acc >> nbits
                low[nb] = (w >> 24) & 0xFF
                low[nb + 1] = (w >> 16) & 0xFF
                low[nb + 2] = (w >> 8) & 0xFF
                low[nb + 3] = w & 0xFF
                nb += 4
                acc &= (1 << nbits) - 1
        i += 4
    while nbits >= 8:
        nbits -= 8
        low[nb] = (acc >> nbits) & 0xFF
        nb += 1
    acc &= (1 << nbits) - 1
    while i < n:
        v = np.int64(p[i])
        g = v - prev - 1
        prev = v
        left = r
        while left > 0:
            take = left if left <= 48 else 48
            left -= take
            nb, acc, nbits = _append_bits(low, nb, acc, nbits, (g >> left) & ((1 << take) - 1), take)
        i += 1
    return _flush_bits(low, nb, acc, nbits)


@_jit
def gaps_join(sym, esc, r, low, excess, max_pos, out, packed):
    """Inverse of gaps_split with every check: positions into int64 `out`, each <= max_pos
    (numel - 1, so that numel = 2**63 fits an int64). esc < 0: no escape symbol. The gaps'
    low bits are packed in `low` (gaps_rans), or, without `packed`, the low r bits of
    out[i] (as prefix_split leaves them; `low` is then unused).

    Returns 0, or -1 truncated low bits, -2 non-zero padding, -3 escapes count mismatch,
    -4 gap beyond 2**63, -5 position > max_pos."""
    m = sym.size
    nlow = low.size
    if packed and r and (m * r + 7) // 8 != nlow:
        return -1
    big = (1 << 63) - 1
    prev = -1
    ne = 0
    # r <= 32: the low bits come from a buffer refilled 32 bits (4 bytes, big-endian) at a
    # time, zeros past the end (m * r <= 8 * nlow is checked above), instead of a loop over
    # bytes per gap. Wider shifts read byte by byte.
    acc = 0
    nbits = 0
    nb = 0
    lowmask = (1 << r) - 1
    bitpos = 0  # r > 32
    for i in range(m):
        q = np.int64(sym[i])
        if q == esc:
            if ne >= excess.size:
                return -3
            x = excess[ne]
            ne += 1
            if x > (big >> r) - esc:
                return -4
            q += x
        if q > (big >> r):
            return -4
        g = q << r
        if not packed:
            g |= out[i] & lowmask
        elif r <= 32:
            if nbits < r:
                w = 0
                for k in range(4):
                    w = (w << 8) | (np.int64(low[nb + k]) if nb + k < nlow else 0)
                nb += 4
                acc = ((acc & ((1 << nbits) - 1)) << 32) | w
                nbits += 32
            nbits -= r
            g |= (acc >> nbits) & lowmask
        else:
            lowv = 0
            need = r
            while need > 0:
                avail = 8 - (bitpos & 7)
                take = avail if avail <= need else need
                byte = np.int64(low[bitpos >> 3])
                lowv = (lowv << take) | ((byte >> (avail - take)) & ((1 << take) - 1))
                need -= take
                bitpos += take
            g |= lowv
        # position = prev + 1 + g <= max_pos < 2**63: checked before adding
        if g > max_pos - 1 - prev:
            return -5
        prev = prev + 1 + g
        out[i] = prev
    if ne != excess.size:
        return -3
    return 0 if not packed or _zeros_from(low, m * r) else -2


@_jit
def _zeros_from(low, bitpos):
    """Whether every bit of `low` from bit `bitpos` on (MSB first) is zero: the padding
    after a gaps section's last low bits."""
    while bitpos < 8 * low.size:
        if (np.int64(low[bitpos >> 3]) >> (7 - (bitpos & 7))) & 1:
            return False
        bitpos += 1
    return True


@_jit
def gaps_escapes(out, esc, r, low, excess, max_pos):
    """The end of `rans_decode_joint_gaps`' join, with `gaps_join`'s checks and statuses:
    out holds the positions joined with every escaped quotient taken as esc; each escape
    (a gap whose quotient is esc: its low bits are the gap's, the excess is excess[k] for
    the k-th) now gets its excess, and every later position moves up with it. Returns 0,
    or -2 non-zero padding, -4 gap beyond 2**63, -5 position > max_pos, for the first
    gap that `gaps_join` would have refused (escapes counted by the decoder: no -3).
    Without escapes only the last position needs the bound (the positions increase)."""
    m = out.size
    if excess.size == 0:
        if m and out[m - 1] > max_pos:
            return -5
        return 0 if _zeros_from(low, m * r) else -2
    big = (1 << 63) - 1
    lowmask = (1 << r) - 1
    raw = -1  # the position before, as the decoder joined it
    prev = -1  # the same, with the excesses before it
    ne = 0
    for i in range(m):
        g = out[i] - raw - 1
        raw = out[i]
        if g >> r == esc:
            x = excess[ne]
            ne += 1
            if x > (big >> r) - esc:
                return -4
            g = ((esc + x) << r) | (g & lowmask)
        if g > max_pos - 1 - prev:
            return -5
        prev = prev + 1 + g
        out[i] = prev
    return 0 if _zeros_from(low, m * r) else -2


# ======================================================================== prefix codes (v6)


PREFIX_LANES = 4  # change i's bits are in lane i % 4: four chains for the decoder to overlap


@_jit_inline
def _prefix_code(a, na, table, bits):
    """(a, na, symbol, status) after the code at the top of the bit buffer a: looked up
    in a decode table of 2**bits slots (-1: no code starts there: status -2, symbol 0)."""
    e = np.int64(table[a >> np.uint64(64 - bits)])
    st = 0
    if e < 0:
        st = -2
        e = 0
    k = e & 15
    return a << np.uint64(k), na - k, e >> 4, st


@_jit_inline
def _prefix_change(buf, t, end, a, na, r, q_table, q_bits, v_table, v_bits):
    """One change of a lane (see prefix_split): the lane's state (next byte t, bits a, of
    which the top na are valid) in and out, with the change's quotient symbol, value
    symbol, r low bits and status (0, -1 the lane ends inside it, -2 an unknown code).
    Written for scalars so that four lanes' states stay in registers: inlined, and
    called four times in a row, their chains overlap. Errors set the status and go on
    with harmless values (the caller stops after the four): no early return."""
    st = 0
    if t > end + 8:  # past the lane's end and the zeros after it
        st = -1
        t = end
    # A refill without a branch, to >= 56 valid bits: a whole word, shifted (the bytes
    # only partly taken are taken again next time). Both codes (<= 13 bits each) and
    # low bits of up to 30 fit; wider ones refill again below.
    a |= _be64(buf, t) >> np.uint64(na)
    t += (63 - na) >> 3
    na |= 56
    a, na, q, sq = _prefix_code(a, na, q_table, q_bits)
    a, na, v, sv = _prefix_code(a, na, v_table, v_bits)
    if sq | sv:
        st = -2
    lowbits = np.uint64(0)
    if r > 30:  # the high r - 30 bits first, then a refill for the rest
        hi = r - 30
        lowbits = a >> np.uint64(64 - hi)
        a <<= np.uint64(hi)
        na -= hi
        if t > end + 8:
            st = -1
            t = end
        a |= _be64(buf, t) >> np.uint64(na)
        t += (63 - na) >> 3
        na |= 56
        lowbits = (lowbits << np.uint64(30)) | (a >> np.uint64(34))
        a <<= np.uint64(30)
        na -= 30
    elif r:
        lowbits = a >> np.uint64(64 - r)
        a <<= np.uint64(r)
        na -= r
    return t, a, na, q, v, lowbits, st


@_jit
def prefix_split(buf, starts, ends, r, q_table, q_bits, v_table, v_bits, qsym, gaps, vsym):
    """Split the PREFIX_LANES bit streams of a `gaps_prefix` section (docs/wire-format.md)
    of qsym.size changes. Change i is in lane i % PREFIX_LANES, MSB first: its quotient's
    code, its value symbol's code, its gap's r low bits. Lane l is buf[starts[l]:ends[l]],
    followed by 16 zero bytes (so that a whole word can always be read). Quotient symbols
    go to qsym, value symbols to vsym, and (q << r) | low bits to gaps (wrapping around
    where that overflows: gaps_join, which turns them into positions, checks q first).

    A code's decode table (prefix.decode_table) has 2**bits slots, indexed by the lane's
    next `bits` bits: (symbol << 4) | the code's length, or -1 where no code starts.

    Returns 0, or -1 a lane ends inside a change, -2 a code not in its table,
    -3 non-zero padding or bytes after a lane's last change."""
    m = qsym.size
    t0, t1, t2, t3 = starts[0], starts[1], starts[2], starts[3]
    e0, e1, e2, e3 = ends[0], ends[1], ends[2], ends[3]
    a0 = a1 = a2 = a3 = np.uint64(0)
    n0 = n1 = n2 = n3 = 0
    ur = np.uint64(r)
    for i in range(0, m, 4):
        t0, a0, n0, q, v, lo, st = _prefix_change(buf, t0, e0, np.uint64(a0), n0, r, q_table, q_bits, v_table, v_bits)
        qsym[i], vsym[i], gaps[i] = q, v, np.int64((np.uint64(q) << ur) | np.uint64(lo))
        if i + 1 < m:
            t1, a1, n1, q, v, lo, s1 = _prefix_change(buf, t1, e1, np.uint64(a1), n1, r, q_table, q_bits,
                                                             v_table, v_bits)
            qsym[i + 1], vsym[i + 1], gaps[i + 1] = q, v, np.int64((np.uint64(q) << ur) | np.uint64(lo))
            st |= s1
        if i + 2 < m:
            t2, a2, n2, q, v, lo, s2 = _prefix_change(buf, t2, e2, np.uint64(a2), n2, r, q_table, q_bits,
                                                             v_table, v_bits)
            qsym[i + 2], vsym[i + 2], gaps[i + 2] = q, v, np.int64((np.uint64(q) << ur) | np.uint64(lo))
            st |= s2
        if i + 3 < m:
            t3, a3, n3, q, v, lo, s3 = _prefix_change(buf, t3, e3, np.uint64(a3), n3, r, q_table, q_bits,
                                                             v_table, v_bits)
            qsym[i + 3], vsym[i + 3], gaps[i + 3] = q, v, np.int64((np.uint64(q) << ur) | np.uint64(lo))
            st |= s3
        if st:  # -1 | -2 is -1: a lane that ends early is reported first
            return st
    for ln, t, na in ((0, t0, n0), (1, t1, n1), (2, t2, n2), (3, t3, n3)):
        n = ends[ln] - starts[ln]
        used = 8 * (t - starts[ln]) - na  # bits read, zeros past the end included
        if used > 8 * n:
            return -1
        pad = 8 * n - used
        if pad >= 8 or (pad and (np.int64(buf[ends[ln] - 1]) & ((1 << pad) - 1)) != 0):
            return -3
    return 0


# ======================================================================== rANS


def _mulhi(a, b):
    """High 64 bits of the 128-bit product of two uint64 (compiled: one `mul`)."""
    return np.uint64((int(a) * int(b)) >> 64)


_QUANTIZE_MAX_SUM = 1 << 46  # counts summing below this quantise here (c << 16 stays in int64)


@_jit
def rans_model(counts, freq, cum):
    """A stream's model from int64 symbol counts in one compiled call: the number of
    symbols that occur, or -1 when the counts need `positions.quantize`'s general path (a
    negative count, a sum >= 2**46, or a remainder the most frequent symbol cannot take).
    With two or more symbols it writes `freq` (quantize's fast path, the same integers:
    floor(c * 2**16 / m), raised to 1 where c > 0, the remainder to the first most frequent
    symbol) and `cum`, their exclusive prefix sums; otherwise it leaves both as they are."""
    m = 0
    used = 0
    big = 0
    top = -1
    for k in range(counts.size):
        c = counts[k]
        if c < 0 or c >= _QUANTIZE_MAX_SUM:
            return -1
        used += c > 0
        if c > top:
            top = c
            big = k
        m += c
    if used <= 1:
        return used
    if m >= _QUANTIZE_MAX_SUM:
        return -1
    total = 0
    for k in range(counts.size):
        f = (counts[k] << 16) // m
        if f == 0 and counts[k] > 0:
            f = 1
        freq[k] = f
        total += f
    if freq[big] + PROB_SCALE - total < 1:
        return -1
    freq[big] += PROB_SCALE - total
    _exclusive_sums(freq, cum)
    return used


@_jit_inline
def _exclusive_sums(freq, cum):
    """cum[k] = freq[0] + ... + freq[k - 1]: where each symbol's slots start."""
    at = 0
    for k in range(freq.size):
        cum[k] = at
        at += freq[k]


@_jit
def _rans_tables(freq, cum):
    """Per symbol s, four uint64 at t[4s..4s+3] (f = 0 symbols' are never used): f << 16
    (the state bound of renormalisation), a reciprocal r, 2**16 - f, an addend c, such that
    for every state 1 <= x < f * 2**16, x' = x + mulhi(x, r) * (2**16 - f) + c is the coded
    state (x // f << 16) + x % f + cum. One flat array: a 2-D one costs the coding loop a
    multiply by its row stride per symbol.

    f >= 2: r = ceil(2**64 / f) (< 2**63), c = cum, and mulhi(x, r) = x // f exactly: it
    overshoots x / f by less than x / 2**64 < 2**-32, while a fractional x / f stays at
    least 1/f > 2**-16 below the next integer. f = 1: r = 2**64 - 1, so mulhi(x, r) =
    x - 1, one short of x // f = x, and c = cum + 2**16 - 1 makes up for it."""
    t = np.zeros(4 * freq.size, np.uint64)
    for k in range(freq.size):
        f = freq[k]
        if f:
            t[4 * k] = np.uint64(f) << np.uint64(16)
            t[4 * k + 2] = np.uint64(PROB_SCALE - f)
            if f == 1:
                t[4 * k + 1] = np.uint64(0xFFFFFFFFFFFFFFFF)
                t[4 * k + 3] = np.uint64(cum[k] + PROB_SCALE - 1)
            else:
                t[4 * k + 1] = np.uint64(0xFFFFFFFFFFFFFFFF) // np.uint64(f) + np.uint64(1)
                t[4 * k + 3] = np.uint64(cum[k])
    return t


@_jit
def _encode_step(x, s, t, out, p):
    """Code symbol s (its four entries in `_rans_tables` t) into state x, storing a renormalisation
    word below out[p] if it needs one: (the new state, the new p). Branch-free: the low
    word is always stored and kept only when the state had to shrink (at most one word
    per symbol, so the store stays inside `out`). No division: after renormalisation
    1 <= x < f * 2**16, and the quotient comes from a 64 x 64 -> 128-bit multiply by a
    reciprocal. Unsigned throughout, so indexing needs no negative-index handling."""
    at = s << np.uint64(2)
    big = x >= t[at]
    out[p - np.uint64(1)] = np.uint16(x & np.uint64(0xFFFF))
    p -= np.uint64(big)
    x = (x >> np.uint64(16)) if big else x
    return x + _mulhi(x, t[at + np.uint64(1)]) * t[at + np.uint64(2)] + t[at + np.uint64(3)], p


@_jit
def _encode_finish(x0, x1, out, p):
    """Store the final states below out[p] (x0 low, x0 high, x1 low, x1 high, in stream
    order): the index of the stream's first word."""
    out[p - np.uint64(1)] = np.uint16(x1 >> np.uint64(16))
    out[p - np.uint64(2)] = np.uint16(x1 & np.uint64(0xFFFF))
    out[p - np.uint64(3)] = np.uint16(x0 >> np.uint64(16))
    out[p - np.uint64(4)] = np.uint16(x0 & np.uint64(0xFFFF))
    return np.int64(p) - 4


@_jit
def rans_encode(sym, freq, cum, out):
    """Two-way interleaved rANS: symbol i is coded by state i % 2.

    Encodes in reverse, writing 16-bit words backwards into `out` (size >= len(sym) + 4);
    returns the index of the first word, so the stream is out[i:]: the four words of
    the final states (x0 low, x0 high, x1 low, x1 high), then the renormalisation words
    in the order the decoder reads them. freq: quantised frequencies (sum 2**16, every
    coded symbol's >= 1 and < 2**16); cum: their exclusive prefix sums.

    One `_encode_step` per symbol; the loop takes the symbols two at a time, odd then
    even, so the two states' dependency chains overlap without moving values between
    registers (swapping the states after every symbol instead ran ~20% slower)."""
    t = _rans_tables(freq, cum)
    x0 = np.uint64(RANS_L)
    x1 = np.uint64(RANS_L)
    p = np.uint64(out.size)
    i = np.uint64(sym.size)
    if i % np.uint64(2):  # the last symbol has an even index: state 0's
        i -= np.uint64(1)
        x0, p = _encode_step(x0, np.uint64(sym[i]), t, out, p)
    while i:
        i -= np.uint64(2)
        x1, p = _encode_step(x1, np.uint64(sym[i + np.uint64(1)]), t, out, p)
        x0, p = _encode_step(x0, np.uint64(sym[i]), t, out, p)
    return _encode_finish(x0, x1, out, p)


@_jit
def rans_encode2(sym1, freq1, cum1, out1, sym2, lut2, freq2, cum2, out2):
    """`rans_encode` of two streams of the same length in one pass: (start1, start2), with
    out1[start1:] / out2[start2:] exactly the words of rans_encode(sym1, freq1, cum1, ...)
    and rans_encode(lut2[sym2], freq2, cum2, ...) (lut2 maps values to symbols, so the
    values need no separate symbol array). Four independent states (two per stream):
    four dependency chains overlap."""
    t1 = _rans_tables(freq1, cum1)
    t2 = _rans_tables(freq2, cum2)
    x0 = np.uint64(RANS_L)
    x1 = np.uint64(RANS_L)
    y0 = np.uint64(RANS_L)
    y1 = np.uint64(RANS_L)
    p = np.uint64(out1.size)
    r = np.uint64(out2.size)
    i = np.uint64(sym1.size)
    if i % np.uint64(2):
        i -= np.uint64(1)
        x0, p = _encode_step(x0, np.uint64(sym1[i]), t1, out1, p)
        y0, r = _encode_step(y0, np.uint64(lut2[sym2[i]]), t2, out2, r)
    while i:
        i -= np.uint64(2)
        j = i + np.uint64(1)
        x1, p = _encode_step(x1, np.uint64(sym1[j]), t1, out1, p)
        y1, r = _encode_step(y1, np.uint64(lut2[sym2[j]]), t2, out2, r)
        x0, p = _encode_step(x0, np.uint64(sym1[i]), t1, out1, p)
        y0, r = _encode_step(y0, np.uint64(lut2[sym2[i]]), t2, out2, r)
    return _encode_finish(x0, x1, out1, p), _encode_finish(y0, y1, out2, r)


# Symbols the decoders take without a bounds check on the words: a symbol reads at most one
# word, so a block of this many needs only one check that as many words remain.
RANS_BLOCK = 32


@_jit
def _rans_start(words):
    """(status, x0, x1): the initial states of a stream, status -1 when they are bad."""
    if words.size < 4:
        return -1, 0, 0
    x0 = np.int64(words[0]) | (np.int64(words[1]) << 16)
    x1 = np.int64(words[2]) | (np.int64(words[3]) << 16)
    if x0 < RANS_L or x1 < RANS_L:
        return -1, 0, 0
    return 0, x0, x1


@_jit
def _rans_finish(words, freq, cum, slot2sym, out, i, xa, xb, ptr):
    """Decode symbols i.. of a stream with every check (the tail after the blocks) and
    check its end: the status of `rans_decode`."""
    nw = words.size
    for k in range(i, out.size):
        slot = xa & 0xFFFF
        s = slot2sym[slot]
        out[k] = s
        xa = np.int64(freq[s]) * (xa >> 16) + slot - cum[s]
        if xa < RANS_L:
            if ptr >= nw:
                return -2
            xa = (xa << 16) | np.int64(words[ptr])
            ptr += 1
        xa, xb = xb, xa
    if xa != RANS_L or xb != RANS_L or ptr != nw:
        return -3
    return 0


@_jit
def _decode_step(x, words, p, freq, cum, slot2sym, out, k):
    """Decode one symbol from state x into out[k], reading words[p] if the state needs
    renormalising: (the new state, the new p). Branch-free: the next word is always
    loaded and kept only when the state is below 2**16 (a branch there is mispredicted
    about as often as it is taken), so the caller guarantees words[p] exists. Unsigned
    throughout, so indexing needs no negative-index handling."""
    slot = x & np.uint64(0xFFFF)
    sym = slot2sym[slot]
    out[k] = sym
    return _decode_next(x, slot, np.uint64(sym), words, p, freq, cum)


@_jit
def _decode_next(x, slot, s, words, p, freq, cum):
    """The state after decoding symbol s (whose slot range holds `slot`) from state x,
    renormalised branch-free from words[p]: (the new state, the new p)."""
    x = np.uint64(freq[s]) * (x >> np.uint64(16)) + slot - np.uint64(cum[s])
    small = x < np.uint64(RANS_L)
    w = (x << np.uint64(16)) | np.uint64(words[p])
    return (w if small else x), p + np.uint64(small)


@_jit
def rans_slot_table(freq, cum, slot2sym):
    """A checked model's decoding tables (`rans_decode`): cum[k] the exclusive prefix sum of
    the int64 frequencies freq, slot2sym[slot] the symbol whose range holds the slot, for
    every one of the sum(freq) slots (slot2sym's size). One compiled call where numpy's
    prefix sum, range and repeat took ~9 us a stream (two streams a small record)."""
    at = 0
    for k in range(freq.size):
        cum[k] = at
        slot2sym[at:at + freq[k]] = k
        at += freq[k]


@_jit
def rans_decode(words, freq, cum, slot2sym, out):
    """Decode len(out) symbols of a stream written by rans_encode.

    Returns 0, or -1 bad initial states, -2 the words run out, -3 the stream does not
    end exactly where the symbols do (both states back at 2**16, every word read).
    Symbol k is state k % 2's, and words are read in the order the encoder wrote them.

    In blocks of RANS_BLOCK symbols while that many words remain, `_decode_step` two
    symbols at a time (state 0's then state 1's: their dependency chains overlap); the
    rest goes through `_rans_finish`, which checks every read."""
    status, a, b = _rans_start(words)
    if status:
        return status
    x0 = np.uint64(a)
    x1 = np.uint64(b)
    p = np.uint64(4)
    i = np.uint64(0)
    m = np.uint64(out.size)
    nw = np.uint64(words.size)
    blk = np.uint64(RANS_BLOCK)
    while i + blk <= m and p + blk <= nw:
        for k in range(i, i + blk, 2):
            x0, p = _decode_step(x0, words, p, freq, cum, slot2sym, out, k)
            x1, p = _decode_step(x1, words, p, freq, cum, slot2sym, out, k + np.uint64(1))
        i += blk
    return _rans_finish(words, freq, cum, slot2sym, out, np.int64(i), np.int64(x0), np.int64(x1), np.int64(p))


@_jit
def rans_decode2(words1, freq1, cum1, slot2sym1, out1, words2, freq2, cum2, slot2sym2, out2):
    """`rans_decode` of two streams of the same length (a record's positions and values)
    in one pass: (status1, status2), the symbols and statuses of the two single calls.

    Four states (two per stream), so four dependency chains overlap, in blocks as in
    rans_decode while both streams have RANS_BLOCK words left. Each stream's tail is
    decoded on its own, with every check."""
    st1, a, b = _rans_start(words1)
    st2, c, d = _rans_start(words2)
    if st1 or st2 or out1.size != out2.size:
        return rans_decode(words1, freq1, cum1, slot2sym1, out1), rans_decode(words2, freq2, cum2, slot2sym2, out2)
    x0 = np.uint64(a)
    x1 = np.uint64(b)
    y0 = np.uint64(c)
    y1 = np.uint64(d)
    p = np.uint64(4)
    q = np.uint64(4)
    i = np.uint64(0)
    m = np.uint64(out1.size)
    n1 = np.uint64(words1.size)
    n2 = np.uint64(words2.size)
    blk = np.uint64(RANS_BLOCK)
    while i + blk <= m and p + blk <= n1 and q + blk <= n2:
        for k in range(i, i + blk, 2):
            j = k + np.uint64(1)
            x0, p = _decode_step(x0, words1, p, freq1, cum1, slot2sym1, out1, k)
            y0, q = _decode_step(y0, words2, q, freq2, cum2, slot2sym2, out2, k)
            x1, p = _decode_step(x1, words1, p, freq1, cum1, slot2sym1, out1, j)
            y1, q = _decode_step(y1, words2, q, freq2, cum2, slot2sym2, out2, j)
        i += blk
    return (_rans_finish(words1, freq1, cum1, slot2sym1, out1, np.int64(i), np.int64(x0), np.int64(x1), np.int64(p)),
            _rans_finish(words2, freq2, cum2, slot2sym2, out2, np.int64(i), np.int64(y0), np.int64(y1), np.int64(q)))


# ------------------------------------------------------------------ joint (v5)
# One symbol per change for a record's (gap quotient, value symbol) pair: j = q * a2 + v, in
# one stream of four states (symbol i coded by state i % 4), whose model is the product of
# the two streams' quantised models (`rans_product_model`): no table of its own on the wire.
# One coding step per change where the paired streams take two, and four chains in the
# decoder (two states would leave its chain of table loads exposed).


@_jit
def rans_product_model(f1, f2, freq):
    """The joint model of two quantised models (each summing to 2**16) into int64 `freq`
    (size f1.size * f2.size; cell q * f2.size + v): round(f1[q] * f2[v] / 2**16) (halves
    up), raised to 1 where both are non-zero, the remainder (either sign) to the first
    largest cell. Returns the number of non-zero cells, or -1 when the largest cell could
    not take the remainder (never for models that sum to 2**16; checked all the same)."""
    a2 = f2.size
    total = 0
    big = 0
    top = -1
    used = 0
    for q in range(f1.size):
        for v in range(a2):
            k = q * a2 + v
            f = (f1[q] * f2[v] + (PROB_SCALE >> 1)) >> PROB_BITS
            if f == 0 and f1[q] > 0 and f2[v] > 0:
                f = 1
            freq[k] = f
            total += f
            used += f > 0
            if f > top:
                top = f
                big = k
    if used == 0 or freq[big] + PROB_SCALE - total < 1:
        return -1
    freq[big] += PROB_SCALE - total
    return used


@_jit
def model_bits(counts, freq):
    """Bits of coding symbols with these int64 counts by the quantised model `freq` (16 -
    log2 f each; symbols that do not occur cost nothing). One compiled loop where numpy's
    masks and log took ~10 us a call, three calls a joint record."""
    bits = 0.0
    for s in range(counts.size):
        if counts[s] > 0:
            bits += counts[s] * (PROB_BITS - np.log2(np.float64(freq[s])))
    return bits


@_jit
def joint_excess_bits(f1, f2, c1, c2, freq):
    """Estimated extra bits of coding counts c1 / c2 (int64, per symbol of models f1 / f2)
    through the joint model `freq` (`rans_product_model`) instead of as two streams, with
    the pairs taken as independent: sum over cells of c1[q] * c2[v] / n * (log2 f1[q] *
    f2[v] / 2**16 - log2 freq[cell]). Small when the cells are few: each cell's rounding."""
    n = 0
    for q in range(c1.size):
        n += c1[q]
    if n == 0:
        return 0.0
    a2 = f2.size
    out = 0.0
    for q in range(f1.size):
        if c1[q] == 0:
            continue
        row = 0.0
        for v in range(a2):
            if c2[v] == 0:
                continue
            f = freq[q * a2 + v]
            row += c2[v] * (np.log2(f1[q] * f2[v] / PROB_SCALE) - np.log2(f))
        out += c1[q] * row
    return out / n


@_jit
def joint_model(f1, f2, c1, c2, value_bits, max_excess, freq, cum):
    """A joint stream's model, or why not (`joint.encode_joint`), in one compiled call:
    0 when the values' stream would take more than `value_bits` bits (model_bits), when
    the product model (`rans_product_model`, into int64 `freq`) has fewer than two cells,
    or when its estimated rounding (`joint_excess_bits`) exceeds `max_excess` of the two
    streams' bits; else 1, with cum the product's exclusive prefix sums. The same
    decisions and model as those calls one by one, which with numpy's prefix sums took
    ~13 us a record."""
    bits2 = model_bits(c2, f2)
    if bits2 > value_bits:
        return 0
    if rans_product_model(f1, f2, freq) < 2:
        return 0
    if joint_excess_bits(f1, f2, c1, c2, freq) > max_excess * (model_bits(c1, f1) + bits2):
        return 0
    _exclusive_sums(freq, cum)
    return 1


@_jit
def _encode_finish4(x0, x1, x2, x3, out, p):
    """Store four final states below out[p] (x0 low, x0 high, ... x3 high, in stream
    order): the index of the stream's first word."""
    out[p - np.uint64(1)] = np.uint16(x3 >> np.uint64(16))
    out[p - np.uint64(2)] = np.uint16(x3 & np.uint64(0xFFFF))
    out[p - np.uint64(3)] = np.uint16(x2 >> np.uint64(16))
    out[p - np.uint64(4)] = np.uint16(x2 & np.uint64(0xFFFF))
    return _encode_finish(x0, x1, out, p - np.uint64(4))


@_jit
def _joint_symbol(sym1, sym2, lut2, row, i):
    """row[q] = q * a2: a load where the multiply cost the coding loop more."""
    return row[sym1[i]] + np.uint64(lut2[sym2[i]])


@_jit
def rans_encode_joint(sym1, sym2, lut2, a2, freq, cum, out):
    """The joint stream of symbols j_i = sym1[i] * a2 + lut2[sym2[i]] (lut2 maps values to
    their symbols, as in `rans_encode2`): four interleaved states, symbol i coded by state
    i % 4, in reverse, words written backwards into `out` (size >= len(sym1) + 8). Returns
    the index of the first word: out[i:] is the eight words of the final states (x0 low,
    x0 high, ..., x3 high), then the renormalisation words in the order the decoder reads
    them. freq / cum: the joint model (every coded symbol's frequency in [1, 2**16))."""
    t = _rans_tables(freq, cum)
    row = np.arange(freq.size // a2).astype(np.uint64) * np.uint64(a2)  # row[q]: quotient q's first cell
    x0 = np.uint64(RANS_L)
    x1 = np.uint64(RANS_L)
    x2 = np.uint64(RANS_L)
    x3 = np.uint64(RANS_L)
    p = np.uint64(out.size)
    n = np.uint64(sym1.size)
    i = n - n % np.uint64(4)
    # the last n % 4 symbols first (indices i.. n-1, states 0..2), the last one first
    if n - i > np.uint64(2):
        x2, p = _encode_step(x2, _joint_symbol(sym1, sym2, lut2, row, i + np.uint64(2)), t, out, p)
    if n - i > np.uint64(1):
        x1, p = _encode_step(x1, _joint_symbol(sym1, sym2, lut2, row, i + np.uint64(1)), t, out, p)
    if n - i > np.uint64(0):
        x0, p = _encode_step(x0, _joint_symbol(sym1, sym2, lut2, row, i), t, out, p)
    while i:
        i -= np.uint64(4)
        x3, p = _encode_step(x3, _joint_symbol(sym1, sym2, lut2, row, i + np.uint64(3)), t, out, p)
        x2, p = _encode_step(x2, _joint_symbol(sym1, sym2, lut2, row, i + np.uint64(2)), t, out, p)
        x1, p = _encode_step(x1, _joint_symbol(sym1, sym2, lut2, row, i + np.uint64(1)), t, out, p)
        x0, p = _encode_step(x0, _joint_symbol(sym1, sym2, lut2, row, i), t, out, p)
    return _encode_finish4(x0, x1, x2, x3, out, p)


@_jit
def rans_joint_table(freq, a2, vmap, slots, cells):
    """The decoding tables of a joint stream of model `freq` (cells q * a2 + v). Each used
    cell (non-zero frequency) has one uint64 entry with what a decoding step needs: its
    frequency (bits 0-15), the first slot of its range (16-31), the quotient q (32-39) and
    vmap[v] (40-55: the value symbol, vmap = arange(a2), or the value itself where vmap is
    the values' table of 8- or 16-bit values). Two forms (`joint.decode_joint` picks one
    for the host's L2):
    - per slot (`slots` empty): cells[slot] is the entry of the slot's cell, for each of
      the 2**16 slots (512 KB): a decoding step loads one entry;
    - indexed (`slots` of 2**16 uint8 or uint16): cells[k] is the k-th used cell's entry
      and slots[slot] its k: two loads a step, from 64-128 KB and a few KB, which stay in a
      512 KB L2 that the per-slot table fills (its loads then go on to L3).
    Returns 0, or -1 when the model does not cover the slots exactly (a negative, 2**16 or
    larger frequency, or a sum other than 2**16: slots would then be left unwritten) or
    the tables are too small for it."""
    direct = slots.size == 0
    if (cells.size if direct else slots.size) != PROB_SCALE:
        return -1
    at = 0
    k = 0
    for s in range(freq.size):
        f = freq[s]
        if f < 0 or f >= PROB_SCALE or at + f > PROB_SCALE:
            return -1
        if f == 0:
            continue
        e = (np.uint64(f) | (np.uint64(at) << np.uint64(16)) | (np.uint64(s // a2) << np.uint64(32))
             | ((np.uint64(vmap[s % a2]) & np.uint64(0xFFFF)) << np.uint64(40)))
        if direct:
            cells[at:at + f] = e
        else:
            if k >= cells.size or k >= 1 << (8 * slots.itemsize):
                return -1
            cells[k] = e
            slots[at:at + f] = k
        at += f
        k += 1
    return 0 if at == PROB_SCALE else -1


@_jit
def _slot_entry(slots, cells, slot):
    """A slot's entry in the per-slot form of `rans_joint_table`."""
    return cells[slot]


@_jit
def _indexed_entry(slots, cells, slot):
    """A slot's entry in the indexed form of `rans_joint_table`."""
    return cells[slots[slot]]


@_jit
def _joint_step(x, words, p, slots, cells, entry):
    """One decoding step of a joint stream through its `rans_joint_table` (`entry`: the
    form's lookup, `_slot_entry` or `_indexed_entry`), branch-free: (the next state, the
    next word, the symbol's entry: its quotient in bits 32-39, its value field in 40-55)."""
    slot = x & np.uint64(0xFFFF)
    e = entry(slots, cells, slot)
    x = (e & np.uint64(0xFFFF)) * (x >> np.uint64(16)) + slot - ((e >> np.uint64(16)) & np.uint64(0xFFFF))
    small = x < np.uint64(RANS_L)
    w = (x << np.uint64(16)) | np.uint64(words[p])
    return (w if small else x), p + np.uint64(small), e


@_jit
def _decode_step_joint(x, words, p, slots, cells, entry, q, v, k):
    """`_joint_step`, the symbol's quotient and value field (its value symbol or its value)
    to q[k] / v[k]: (the next state, the next word)."""
    x, p, e = _joint_step(x, words, p, slots, cells, entry)
    q[k] = (e >> np.uint64(32)) & np.uint64(0xFF)
    v[k] = (e >> np.uint64(40)) & np.uint64(0xFFFF)
    return x, p


@_jit
def _joint_blocks(words, slots, cells, entry, q, v, x0, x1, x2, x3):
    """`rans_decode_joint`'s blocks of 4 symbols (one per state) while 4 words remain,
    branch-free, from the four initial states: (the states, next word, symbols decoded).
    `entry` is a compile-time choice (each form gets its own compiled loop)."""
    p = np.uint64(8)
    i = np.uint64(0)
    m = np.uint64(q.size)
    four = np.uint64(4)
    while i + four <= m and p + four <= np.uint64(words.size):
        x0, p = _decode_step_joint(x0, words, p, slots, cells, entry, q, v, i)
        x1, p = _decode_step_joint(x1, words, p, slots, cells, entry, q, v, i + np.uint64(1))
        x2, p = _decode_step_joint(x2, words, p, slots, cells, entry, q, v, i + np.uint64(2))
        x3, p = _decode_step_joint(x3, words, p, slots, cells, entry, q, v, i + np.uint64(3))
        i += four
    return x0, x1, x2, x3, p, i


@_jit
def _joint_states(words, xs):
    """The four initial states of a joint stream into xs: False when they are not states
    (fewer than 8 words, or one below 2**16)."""
    if words.size < 8:
        return False
    for k in range(4):
        xs[k] = np.int64(words[2 * k]) | (np.int64(words[2 * k + 1]) << 16)
        if xs[k] < RANS_L:
            return False
    return True


@_jit_inline
def _joint_checked_step(xs, k, words, ptr, slots, cells, direct):
    """Symbol k past the blocks, with state xs[k % 4], the words' end checked: (its entry,
    the next word), or (0, -1) where the words run out."""
    x = xs[k % 4]
    slot = x & 0xFFFF
    e = np.int64(cells[slot] if direct else cells[slots[slot]])
    x = (e & 0xFFFF) * (x >> 16) + slot - ((e >> 16) & 0xFFFF)
    if x < RANS_L:
        if ptr >= words.size:
            return 0, -1
        x = (x << 16) | np.int64(words[ptr])
        ptr += 1
    xs[k % 4] = x
    return e, ptr


@_jit_inline
def _joint_ended(xs, ptr, words):
    """0 where a joint stream ends exactly where its symbols do (all four states back at
    2**16, every word read), else -3."""
    for k in range(4):
        if xs[k] != RANS_L:
            return -3
    return 0 if ptr == words.size else -3


@_jit
def rans_decode_joint(words, slots, cells, q, v):
    """Decode len(q) symbols of a stream written by `rans_encode_joint` into their
    quotients q and value fields v (value symbols or values: the `rans_joint_table`
    through which it decodes says which; an empty `slots`: its per-slot form). Returns 0,
    or -1 bad initial states, -2 the words run out, -3 the stream does not end exactly
    where the symbols do (all four states back at 2**16, every word read).

    In blocks of 4 symbols (one per state) while 4 words remain, branch-free; the rest one
    symbol at a time with every check."""
    xs = np.empty(4, np.int64)
    if not _joint_states(words, xs):
        return -1
    x0, x1, x2, x3 = np.uint64(xs[0]), np.uint64(xs[1]), np.uint64(xs[2]), np.uint64(xs[3])
    direct = slots.size == 0
    if direct:
        x0, x1, x2, x3, p, i = _joint_blocks(words, slots, cells, _slot_entry, q, v, x0, x1, x2, x3)
    else:
        x0, x1, x2, x3, p, i = _joint_blocks(words, slots, cells, _indexed_entry, q, v, x0, x1, x2, x3)
    xs[0], xs[1], xs[2], xs[3] = np.int64(x0), np.int64(x1), np.int64(x2), np.int64(x3)
    ptr = np.int64(p)
    for k in range(np.int64(i), q.size):
        e, ptr = _joint_checked_step(xs, k, words, ptr, slots, cells, direct)
        if ptr < 0:
            return -2
        q[k] = (e >> 32) & 0xFF
        v[k] = (e >> 40) & 0xFFFF
    return _joint_ended(xs, ptr, words)


@_jit_inline
def _joined_gap(e, esc, r, low, skip, v, out, k, prev, ne):
    """Symbol k of a joint stream, from its entry e: its value field to v[k], and its gap
    (quotient q, the r low bits at bit k * r - skip of `low`) joined: out[k] = prev + 1 +
    (q << r | low bits); returns the next prev. An escaped quotient joins as esc
    (`gaps_escapes` adds its excess afterwards) and is counted in ne: no branch on the
    decoded symbol. The caller keeps the 8 bytes from the bits' first one inside low."""
    v[k] = (e >> np.uint64(40)) & np.uint64(0xFFFF)
    q = np.int64((e >> np.uint64(32)) & np.uint64(0xFF))
    at = np.int64(k) * r - skip
    bits = np.int64((_be64(low, at >> 3) << np.uint64(at & 7)) >> np.uint64(64 - r))
    ne += q == esc
    prev += 1 + ((q << r) | bits)
    out[k] = prev
    return prev, ne


@_jit_inline
def _joint_gaps_blocks(words, slots, cells, entry, v, esc, r, low, out, x0, x1, x2, x3):
    """`_joint_blocks` with each symbol's gap joined as it is decoded (`_joined_gap`), for
    the gaps whose low bits' 8-byte window lies inside `low`: (the states, next word,
    symbols decoded, the last position, escapes seen)."""
    p = np.uint64(8)
    i = np.uint64(0)
    # gap k's window starts at byte (k * r) >> 3: inside low for k * r <= 8 * low.size - 57
    m = np.uint64(min(v.size, max(0, (8 * low.size - 57) // r + 1)))
    four = np.uint64(4)
    prev = -1
    ne = 0
    while i + four <= m and p + four <= np.uint64(words.size):
        x0, p, e = _joint_step(x0, words, p, slots, cells, entry)
        prev, ne = _joined_gap(e, esc, r, low, 0, v, out, i, prev, ne)
        x1, p, e = _joint_step(x1, words, p, slots, cells, entry)
        prev, ne = _joined_gap(e, esc, r, low, 0, v, out, i + np.uint64(1), prev, ne)
        x2, p, e = _joint_step(x2, words, p, slots, cells, entry)
        prev, ne = _joined_gap(e, esc, r, low, 0, v, out, i + np.uint64(2), prev, ne)
        x3, p, e = _joint_step(x3, words, p, slots, cells, entry)
        prev, ne = _joined_gap(e, esc, r, low, 0, v, out, i + np.uint64(3), prev, ne)
        i += four
    return x0, x1, x2, x3, p, i, prev, ne


@_jit
def rans_decode_joint_gaps(words, slots, cells, v, esc, r, low, out):
    """`rans_decode_joint` and the gaps' join (`gaps_join`, packed low bits) in one pass:
    each symbol's value field to v, its gap's position to out (int64), for a Rice shift
    r >= 1 and low holding the len(v) gaps' low bits. Where a
    separate join read back each quotient and took a branch per gap to refill its bit
    buffer, a gap's low bits here are one load at its bit offset (k * r), and the join's
    few instructions fill the decoder's waits on its state chains. Returns (status, escapes):
    the status as `rans_decode_joint`'s; the quotients equal to esc (escapes) joined as esc
    and counted, for `gaps_escapes` to add their excess and to check every position (the
    caller keeps len(v) << (r + 8) < 2**62, so that these sums cannot overflow; it also keeps
    r <= 53, so a gap's low bits and the up to 7 bits before them fit one 64-bit load)."""
    xs = np.empty(4, np.int64)
    if not _joint_states(words, xs):
        return -1, 0
    x0, x1, x2, x3 = np.uint64(xs[0]), np.uint64(xs[1]), np.uint64(xs[2]), np.uint64(xs[3])
    direct = slots.size == 0
    if direct:
        x0, x1, x2, x3, p, i, prev, ne = _joint_gaps_blocks(words, slots, cells, _slot_entry, v, esc, r, low,
                                                            out, x0, x1, x2, x3)
    else:
        x0, x1, x2, x3, p, i, prev, ne = _joint_gaps_blocks(words, slots, cells, _indexed_entry, v, esc, r,
                                                            low, out, x0, x1, x2, x3)
    xs[0], xs[1], xs[2], xs[3] = np.int64(x0), np.int64(x1), np.int64(x2), np.int64(x3)
    ptr = np.int64(p)
    # the rest: their low bits from a copy with 8 zero bytes after them
    first = (np.int64(i) * r) >> 3
    rest = np.zeros(low.size - first + 8, np.uint8)
    rest[:low.size - first] = low[first:]
    for k in range(np.int64(i), v.size):
        e, ptr = _joint_checked_step(xs, k, words, ptr, slots, cells, direct)
        if ptr < 0:
            return -2, 0
        prev, ne = _joined_gap(np.uint64(e), esc, r, rest, 8 * first, v, out, k, prev, ne)
    return _joint_ended(xs, ptr, words), ne


# ======================================================================== values


# histogram_lines' compare path: at least _FEW_MIN 16-bit values whose first _FEW_SAMPLE
# (or all, rounded down to 32) have at most _FEW distinct ones (+-1-ULP xor deltas: ~10 of
# them; add deltas: 2) are counted 32 at a time.
_FEW, _FEW_SAMPLE, _FEW_MIN = 16, 4096, 1024


@_jit
def histogram_lines(vals, table, lines, distinct, found):
    """Distinct unsigned values, ascending, into `distinct` and their counts into `found`;
    returns how many. For at most 2**32 values (a counter must not wrap).

    table: four uint32 counters per possible value (value v's at 4v..4v+3), so that one
    64-byte line of it holds four values'; lines: a uint8 flag per such line (a multiple of
    8 of them), set when a value in it is counted, and scanned 8 at a time. Both must be
    all zero, and are again on return: a call costs its values and the lines they touch,
    never a pass over all the bins (~60 us for 2**16 of them).

    Value i counts into counter i % 4 of its value: runs of equal values (a few distinct
    deltas are the common case) would otherwise chain every increment on the one before
    (1.0-1.8 ns a value on skewed and on real AdamW deltas, against 0.56-0.64). The flag is
    a plain store, not a read-modify-write, so it adds no such chain.

    At least _FEW_MIN 16-bit values of which the first _FEW_SAMPLE hold at most _FEW
    distinct ones take `_count_few`: one 32-lane compare and popcount per distinct value of
    the sample, the table only for values outside it (+-1-ULP deltas, 1M of them: 0.48-0.61
    against 0.85-0.99 ns a value as xor, 0.12-0.19 against 0.73-1.0 as add; 8-12K of them,
    a mixture-of-experts record at 1%: 5-7 against 14-21 us, 3 against 12-18 as add)."""
    n = vals.size
    if vals.itemsize == 2 and n >= _FEW_MIN and vals.strides[0] == 2:  # the compares read 64 bytes at once
        few = np.empty(_FEW, np.int64)
        k = _distinct_upto(vals, min(_FEW_SAMPLE, n - n % 32), few)
        if k >= 0:
            few = few[:k]
            counts = np.zeros(k, np.int64)
            done = _count_few(vals, 0, few, counts, table, lines)
            _count_lines(vals, done, n, table, lines)
            for c in range(k):
                v = few[c]
                q, left = counts[c] >> 2, counts[c] & 3  # spread over the four counters: none wraps
                for u in range(4):
                    table[4 * v + u] += q + (u < left)
                lines[v >> 2] = 1
            return _collect_lines(table, lines, distinct, found)
    _count_lines(vals, 0, n, table, lines)
    return _collect_lines(table, lines, distinct, found)


@_jit
def _distinct_upto(vals, m, few):
    """The distinct values among vals[:m] (16-bit, contiguous; m a multiple of 32) into
    `few`, in order of first appearance: how many, or -1 as soon as there are more than
    few.size (a wide sample costs a few values).

    32 values a step: one compare per value found so far marks the known lanes; each lane
    left is a new value, taken lowest first, its equal lanes dropped by one more compare.
    Searching the values found one at a time for each sampled value took 13-17 us a
    record (a mispredicted exit a value), 1.9-2.8 us this way."""
    k = 0
    lanes = np.uint64(0xFFFFFFFF)
    for i in range(0, m, 32):
        known = np.uint64(0)
        for c in range(k):
            known |= np.uint64(_eq_mask(vals, i, few[c]))
        rest = ~known & lanes
        while rest:
            v = np.int64(vals[i + np.int64(_ctz64(rest))])
            if k == few.size:
                return -1
            few[k] = v
            k += 1
            rest &= ~np.uint64(_eq_mask(vals, i, v))
    return k


@_jit
def _count_lines(vals, lo, hi, table, lines):
    """Count vals[lo:hi] into `histogram_lines`' tables: value i into counter i % 4."""
    m = hi - (hi - lo) % 4
    for i in range(lo, m, 4):
        for u in range(4):
            v = np.int64(vals[i + u])
            table[4 * v + u] += 1
            lines[v >> 2] = 1
    for i in range(m, hi):
        v = np.int64(vals[i])
        table[4 * v] += 1
        lines[v >> 2] = 1


@_jit
def _collect_lines(table, lines, distinct, found):
    """The counted values, ascending, into distinct / found, the tables zeroed again: how many."""
    words = lines.view(np.uint64)
    k = 0
    for w in range(words.size):
        if words[w] == 0:
            continue
        for line in range(8 * w, 8 * w + 8):
            if lines[line] == 0:
                continue
            for v in range(4 * line, 4 * line + 4):
                j = 4 * v
                c = np.int64(table[j]) + np.int64(table[j + 1]) + np.int64(table[j + 2]) + np.int64(table[j + 3])
                if c:
                    distinct[k] = v
                    found[k] = c
                    k += 1
                    table[j] = 0
                    table[j + 1] = 0
                    table[j + 2] = 0
                    table[j + 3] = 0
        words[w] = 0
    return k


@_jit
def _count_few(vals, lo, few, counts, table, lines):
    """From vals[lo] (16-bit), 32 values at a time: counts[c] += how many equal few[c] (one
    compare and popcount each), and the values equal to none into `histogram_lines`'
    tables, one at a time. Stops where more than one value in 16 so far was none of them
    (the sample did not show what follows: the table is cheaper then). Returns the index it
    stopped at: the caller counts the rest."""
    k = few.size
    one = np.uint64(1)
    lanes = np.uint64(0xFFFFFFFF)
    i = lo
    stop = vals.size - (vals.size - lo) % 32
    missed = 0
    while i < stop:
        seen = np.uint64(0)
        for c in range(k):
            m = _eq_mask(vals, i, few[c])
            counts[c] += _popcount(m)
            seen |= m
        rest = ~seen & lanes
        while rest:
            j = i + np.int64(_ctz64(rest))
            v = np.int64(vals[j])
            table[4 * v + (j & 3)] += 1
            lines[v >> 2] = 1
            missed += 1
            rest &= rest - one
        i += 32
        if missed * 16 > i - lo and (i - lo) % 2048 == 0:
            break
    return i


@_jit
def entropy_of_counts(found, k):
    """Order-0 entropy in bits of a sample with the counts found[:k] (zeros allowed):
    sum c * log2(m / c). `positions.entropy_bits` for any counts."""
    m = np.int64(0)
    for i in range(k):
        m += found[i]
    if m == 0:
        return 0.0
    lm = np.log2(np.float64(m))
    bits = 0.0
    for i in range(k):
        if found[i] > 0:
            c = np.float64(found[i])
            bits += c * (lm - np.log2(c))
    return bits


@_jit
def xor_add_entropies(add, new, table, lines, distinct, found):
    """(entropy bits of the xor values, of the add values) of changes given as their add
    values (new - old, wrapping) and new bits, 16-bit or narrower: xor = new ^ (new - add).
    The tables as `histogram_lines` takes them (left all zero); distinct and found need
    room for min(add.size, 2**width) entries. One call where two histograms and two
    entropies in numpy took ~70 us a record (op "auto"'s sampled choice)."""
    n = add.size
    mask = (np.int64(1) << np.int64(8 * add.itemsize)) - 1
    xs = np.empty(n, add.dtype)
    for i in range(n):
        nw = np.int64(new[i])
        xs[i] = (nw ^ (nw - np.int64(add[i]))) & mask
    hx = entropy_of_counts(found, histogram_lines(xs, table, lines, distinct, found))
    ha = entropy_of_counts(found, histogram_lines(add, table, lines, distinct, found))
    return hx, ha


@_jit
def map_symbols(vals, lut, sym):
    for i in range(vals.size):
        sym[i] = lut[vals[i]]


@_jit
def lookup(sym, table, out):
    for i in range(sym.size):
        out[i] = table[sym[i]]


# ======================================================================== apply


# scatter_apply prefetches the line of the change this many changes ahead. The hardware
# prefetchers follow the sorted positions' stream but not the scattered lines they point
# at; on an Emerald Rapids core (into 1 GiB, 5-27M changes) it took 0.54-0.95x the time of
# none for xor, add and set, 48-96 ahead alike, 16 ahead about half the gain (BENCHMARKS.md).
_SCATTER_PREFETCH = 64
# ... for scatters kept in the modules they serve (nemo_dcr.digest's)
prefetch, SCATTER_PREFETCH = _prefetch, _SCATTER_PREFETCH


@_jit
def scatter_apply(flat, pos, vals, op):
    """In place on an unsigned bit view: flat[pos] ^= vals (op 0), += vals wrapping (op 1)
    or = vals (op 2), checking the positions as it goes: int64 (uint64 ones through
    `positions.signed_view`) or uint32, strictly increasing, in [0, flat.size). Returns 0,
    or 1 + the index of the first position that is not: the changes before it are
    applied, none from it on (the caller takes them back). The check adds nothing to the
    scatter's memory traffic; a pass of its own read 8 bytes a change more, 11-15% of one
    receiver's pause at 3-5% on the 1.07B model (BENCHMARKS.md)."""
    n = pos.size
    size = flat.size
    ahead = n - _SCATTER_PREFETCH  # the changes before this one prefetch a later change's line
    prev = -1
    for i in range(n):
        p = pos[i]
        if p <= prev or p >= size:  # (a negative position is <= prev)
            return i + 1
        prev = p
        if i < ahead:
            _prefetch(flat, np.int64(pos[i + _SCATTER_PREFETCH]))  # a hint: never faults
        if op == 0:
            flat[p] ^= vals[i]
        elif op == 1:
            flat[p] += vals[i]
        else:
            flat[p] = vals[i]
    return 0


# ======================================================================== intrinsics
#
# The compiled forms of _vmask32, _vstep_* (diff16), _ctz64 (diff16_bitscan), _mulhi
# (rANS) and _be64 / _store_be64 (bit streams): LLVM vector, 128-bit integer and unaligned
# byte-swapped operations that numba has no spelling for.
# Without numba the plain Python functions above are called instead (same results).

if _numba is not None:
    from llvmlite import ir as _ir
    from numba.core import cgutils as _cg
    from numba.core import types as _nt
    from numba.extending import intrinsic as _intrinsic
    from numba.extending import overload as _overload

    def _is16(t):
        return isinstance(t, _nt.Array) and isinstance(t.dtype, _nt.Integer) and t.dtype.bitwidth == 16

    def _data(context, builder, ty, val, index):
        """Pointer to element `index` of a C-contiguous array."""
        return builder.gep(context.make_array(ty)(context, builder, val).data, [index])

    @_intrinsic
    def _vmask32_intr(typingctx, a, b, i):
        if not (_is16(a) and _is16(b)):
            return None
        sig = _nt.uint32(a, b, _nt.int64)

        def codegen(context, builder, signature, args):
            vt = _ir.VectorType(_ir.IntType(16), _LANES)
            ta, tb = signature.args[0], signature.args[1]
            va = builder.load(builder.bitcast(_data(context, builder, ta, args[0], args[2]), vt.as_pointer()), align=2)
            vb = builder.load(builder.bitcast(_data(context, builder, tb, args[1], args[2]), vt.as_pointer()), align=2)
            return builder.bitcast(builder.icmp_unsigned("!=", va, vb), _ir.IntType(_LANES))

        return sig, codegen

    @_intrinsic
    def _prefetch_intr(typingctx, a, i):
        if not isinstance(a, _nt.Array):
            return None
        sig = _nt.void(a, _nt.int64)

        def codegen(context, builder, signature, args):
            ptr = builder.bitcast(_data(context, builder, signature.args[0], args[0], args[1]),
                                  _ir.IntType(8).as_pointer())
            i32 = _ir.IntType(32)
            fn = _cg.get_or_insert_function(builder.module, _ir.FunctionType(_ir.VoidType(), [ptr.type, i32, i32, i32]),
                                            "llvm.prefetch.p0")
            # read, locality 3 (all cache levels: prefetcht0), data cache
            builder.call(fn, [ptr, _ir.Constant(i32, 0), _ir.Constant(i32, 3), _ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return sig, codegen

    def _lanes_mask(builder, context, ty, a, i, s, pred):
        """a[i + k] `pred` s (unsigned) for the 512 bits from a[i], as an i64 of lane bits."""
        width = ty.dtype.bitwidth
        lanes = 512 // width
        vt = _ir.VectorType(_ir.IntType(width), lanes)
        v = builder.load(builder.bitcast(_data(context, builder, ty, a, i), vt.as_pointer()), align=1)
        splat = builder.insert_element(_ir.Constant(vt, _ir.Undefined), builder.trunc(s, _ir.IntType(width)),
                                       _ir.Constant(_ir.IntType(32), 0))
        splat = builder.shuffle_vector(splat, _ir.Constant(vt, _ir.Undefined),
                                       _ir.Constant(_ir.VectorType(_ir.IntType(32), lanes), [0] * lanes))
        bits = builder.bitcast(builder.icmp_unsigned(pred, v, splat), _ir.IntType(lanes))
        return bits if lanes == 64 else builder.zext(bits, _ir.IntType(64))

    def _make_lanes_mask(pred):
        @_intrinsic
        def mask(typingctx, a, i, s):
            if not (isinstance(a, _nt.Array) and isinstance(a.dtype, _nt.Integer) and a.dtype.bitwidth in (8, 16)):
                return None
            sig = _nt.uint64(a, _nt.int64, _nt.int64)

            def codegen(context, builder, signature, args):
                return _lanes_mask(builder, context, signature.args[0], args[0], args[1], args[2], pred)

            return sig, codegen

        return mask

    _eq_mask_intr, _ge_mask_intr = _make_lanes_mask("=="), _make_lanes_mask(">=")

    @_intrinsic
    def _popcount_intr(typingctx, x):
        sig = _nt.int64(_nt.uint64)

        def codegen(context, builder, signature, args):
            i64 = _ir.IntType(64)
            ctpop = _cg.get_or_insert_function(builder.module, _ir.FunctionType(i64, [i64]), "llvm.ctpop.i64")
            return builder.call(ctpop, [args[0]])

        return sig, codegen

    @_intrinsic
    def _store_be64_intr(typingctx, a, at, x):
        if not (isinstance(a, _nt.Array) and a.dtype == _nt.uint8):
            return None
        sig = _nt.void(a, _nt.int64, _nt.uint64)

        def codegen(context, builder, signature, args):
            i64 = _ir.IntType(64)
            ptr = builder.bitcast(_data(context, builder, signature.args[0], args[0], args[1]), i64.as_pointer())
            bswap = _cg.get_or_insert_function(builder.module, _ir.FunctionType(i64, [i64]), "llvm.bswap.i64")
            builder.store(builder.call(bswap, [args[2]]), ptr, align=1)
            return context.get_dummy_value()

        return sig, codegen

    @_intrinsic
    def _load_be64_intr(typingctx, a, at):
        if not (isinstance(a, _nt.Array) and a.dtype == _nt.uint8 and a.layout == "C"):
            return None
        sig = _nt.uint64(a, _nt.int64)

        def codegen(context, builder, signature, args):
            i64 = _ir.IntType(64)
            ptr = builder.bitcast(_data(context, builder, signature.args[0], args[0], args[1]), i64.as_pointer())
            bswap = _cg.get_or_insert_function(builder.module, _ir.FunctionType(i64, [i64]), "llvm.bswap.i64")
            return builder.call(bswap, [builder.load(ptr, align=1)])

        return sig, codegen

    def _make_vstep(kind):
        @_intrinsic
        def vstep(typingctx, a, b, i, mask, base, pos, new, v, n):
            if (not all(_is16(t) for t in (a, b, new, v)) or not isinstance(pos, _nt.Array)
                    or not isinstance(pos.dtype, _nt.Integer) or pos.dtype.bitwidth not in (32, 64)):
                return None
            sig = _nt.int64(a, b, _nt.int64, _nt.uint32, _nt.int64, pos, new, v, _nt.int64)

            def codegen(context, builder, signature, args):
                ta, tb, _, _, _, tpos, tnew, tv, _ = signature.args
                a_, b_, i_, mask_, base_, pos_, new_, v_, n_ = args
                i16, i64 = _ir.IntType(16), _ir.IntType(64)
                ipos = _ir.IntType(tpos.dtype.bitwidth)  # int32 positions: half the compress-stores
                v16, vpos = _ir.VectorType(i16, _LANES), _ir.VectorType(ipos, _LANES)
                vmask = _ir.VectorType(_ir.IntType(1), _LANES)
                mod = builder.module
                m = builder.bitcast(mask_, vmask)

                def compress_store(vec, ptr, mask=None, lanes=_LANES):
                    # Register-form compress + one full-width unaligned store: the memory
                    # form (llvm.masked.compressstore) is microcoded and several times slower.
                    # The lanes past the compressed ones land in slots the next step (or
                    # the caller's slack: the buffers have a block of room) overwrites.
                    vt = vec.type
                    mt = _ir.VectorType(_ir.IntType(1), lanes)
                    fnty = _ir.FunctionType(vt, [vt, vt, mt])
                    name = f"llvm.x86.avx512.mask.compress.v{lanes}i{vt.element.width}"
                    fn = _cg.get_or_insert_function(mod, fnty, name)
                    packed = builder.call(fn, [vec, _ir.Constant(vt, None), m if mask is None else mask])
                    builder.store(packed, builder.bitcast(ptr, vt.as_pointer()), align=1)

                va = builder.load(builder.bitcast(_data(context, builder, ta, a_, i_), v16.as_pointer()), align=2)
                vb = builder.load(builder.bitcast(_data(context, builder, tb, b_, i_), v16.as_pointer()), align=2)
                compress_store(va, _data(context, builder, tnew, new_, n_))
                if kind:
                    val = {"old": lambda: vb, "xor": lambda: builder.xor(va, vb),
                           "add": lambda: builder.sub(va, vb)}[kind]()
                    compress_store(val, _data(context, builder, tv, v_, n_))
                start = builder.add(base_, i_)
                if ipos.width < 64:
                    start = builder.trunc(start, ipos)
                undef = _ir.Constant(vpos, _ir.Undefined)
                splat = builder.insert_element(undef, start, _ir.Constant(_ir.IntType(32), 0))
                splat = builder.shuffle_vector(splat, _ir.Constant(vpos, _ir.Undefined),
                                               _ir.Constant(_ir.VectorType(_ir.IntType(32), _LANES), [0] * _LANES))
                iota = _ir.Constant(vpos, [_ir.Constant(ipos, k) for k in range(_LANES)])
                allpos = builder.add(splat, iota)
                # 32 positions are two 16-lane vectors of int32 (four of int64): compress
                # each quarter or half with its slice of the mask, one after the other.
                per = 512 // ipos.width
                lanes_i = _ir.IntType(_LANES)
                at = n_
                for q in range(_LANES // per):
                    part = builder.shuffle_vector(allpos, _ir.Constant(vpos, _ir.Undefined), _ir.Constant(
                        _ir.VectorType(_ir.IntType(32), per), list(range(q * per, (q + 1) * per))))
                    bits = builder.trunc(builder.lshr(mask_, _ir.Constant(lanes_i, q * per)), _ir.IntType(per))
                    compress_store(part, _data(context, builder, tpos, pos_, at),
                                   builder.bitcast(bits, _ir.VectorType(_ir.IntType(1), per)), per)
                    ctq = _cg.get_or_insert_function(mod, _ir.FunctionType(_ir.IntType(per), [_ir.IntType(per)]),
                                                     f"llvm.ctpop.i{per}")
                    at = builder.add(at, builder.zext(builder.call(ctq, [bits]), i64))
                ctpop = _cg.get_or_insert_function(mod, _ir.FunctionType(_ir.IntType(_LANES), [_ir.IntType(_LANES)]),
                                                   f"llvm.ctpop.i{_LANES}")
                return builder.add(n_, builder.zext(builder.call(ctpop, [mask_]), i64))

            return sig, codegen

        return vstep

    @_overload(_vmask32, jit_options={"nogil": True})
    def _ol_vmask32(a, b, i):
        return lambda a, b, i: _vmask32_intr(a, b, i)

    @_overload(_eq_mask, jit_options={"nogil": True})
    def _ol_eq_mask(a, i, s):
        return lambda a, i, s: _eq_mask_intr(a, i, s)

    @_overload(_ge_mask, jit_options={"nogil": True})
    def _ol_ge_mask(a, i, s):
        return lambda a, i, s: _ge_mask_intr(a, i, s)

    @_overload(_popcount, jit_options={"nogil": True})
    def _ol_popcount(x):
        return lambda x: _popcount_intr(np.uint64(x))

    @_overload(_store_be64, jit_options={"nogil": True})
    def _ol_store_be64(a, at, x):
        return lambda a, at, x: _store_be64_intr(a, at, x)

    @_overload(_be64, jit_options={"nogil": True})
    def _ol_be64(b, at):
        if isinstance(b, _nt.Array) and b.layout == "C":
            return lambda b, at: _load_be64_intr(b, np.int64(at))
        return _be64  # strided: byte by byte

    @_overload(_prefetch, jit_options={"nogil": True})
    def _ol_prefetch(a, i):
        return lambda a, i: _prefetch_intr(a, i)

    def _register_vstep(pyfunc, kind):
        intr = _make_vstep(kind)

        @_overload(pyfunc, jit_options={"nogil": True})
        def _ol(a, b, i, mask, base, pos, new, v, n):
            return lambda a, b, i, mask, base, pos, new, v, n: intr(a, b, i, mask, base, pos, new, v, n)

    for _f, _kind in ((_vstep_old, "old"), (_vstep_xor, "xor"), (_vstep_add, "add"), (_vstep_none, "")):
        _register_vstep(_f, _kind)

    @_intrinsic
    def _mulhi_intr(typingctx, a, b):
        sig = _nt.uint64(_nt.uint64, _nt.uint64)

        def codegen(context, builder, signature, args):
            i128 = _ir.IntType(128)
            prod = builder.mul(builder.zext(args[0], i128), builder.zext(args[1], i128))
            return builder.trunc(builder.lshr(prod, _ir.Constant(i128, 64)), _ir.IntType(64))

        return sig, codegen

    from numba.cpython.unsafe.numbers import trailing_zeros as _trailing_zeros

    @_overload(_ctz64, jit_options={"nogil": True})
    def _ol_ctz64(m):
        return lambda m: _trailing_zeros(m)

    @_overload(_drop_lowest, jit_options={"nogil": True})
    def _ol_drop_lowest(m):
        return lambda m: m & (m - np.uint64(1))

    @_overload(_mulhi, jit_options={"nogil": True})
    def _ol_mulhi(a, b):
        return lambda a, b: _mulhi_intr(a, b)
