"""The trainer's diff: changed positions, new bits and xor / add / old values of a shard
against its committed baseline, in one pass.

`diff16` needs AVX-512 (VBMI2) and is only called when the host has it (`HAVE_VECTOR_DIFF`);
elsewhere `diff16_bitscan` (the same compares, and a bit scan of their masks instead of
compresses) gives the same arrays.
"""

from __future__ import annotations

import os

import numpy as np

from .common import _jit, _jit_inline, _numba
from .intrinsics import (
    _ctz64, _drop_lowest, _LANES, _popcount, _prefetch, _vmask32, _vstep_add, _vstep_none,
    _vstep_old, _vstep_xor,
)


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


# The 16-bit scans prefetch both inputs this many elements (4 KiB) ahead of the block they
# compare: without it the compress work of a block that differs stalls the next blocks'
# loads. Measured: faster at 1-5% changes and no different at 0%; 1024-4096 elements ahead
# alike; non-temporal hints slower (benchmarks/results/history.md).
DIFF_PREFETCH = 2048
# `diff16`'s rows when positions take no row skips: (row_end, row_len, row_skip). Passed
# explicitly: numba's specialisation for omitted default arguments ran the scan 7-10% slower.
NO_ROWS = (1 << 62, 1, 0)


@_jit_inline
def _prefetch_block(a, b, i):
    """Prefetch the DIFF_BLOCK elements of a and b from element i: 4 lines of BF16 each."""
    for k in range(0, DIFF_BLOCK, _LANES):
        _prefetch(a, i + k)
        _prefetch(b, i + k)


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
    step. Measured on an AVX2-only core: walking one change a step (one exit per word, taken
    after a varying count) made the diff slower at 3-5%, three or four a step were no faster
    than two, and a walk per 32-lane mask, the word scan `diff_words` and writing a fixed
    number of slots per mask were all slower still. Prefetches as `diff16` does. Like
    `diff16`, it may write slots past the last change (up to two; the buffers' room covers
    them)."""
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
