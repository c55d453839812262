"""Values: histograms of 8- and 16-bit values, their entropy (the op choice), and symbol
lookups for the `symbols_*` value encodings."""

from __future__ import annotations

import numpy as np

from .common import _jit
from .intrinsics import _ctz64, _eq_mask, _popcount


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
    never a pass over all 2**16 bins.

    Value i counts into counter i % 4 of its value: runs of equal values (a few distinct
    deltas are the common case) would otherwise chain every increment on the one before
    (about twice the time a value on skewed and on real AdamW deltas). The flag is
    a plain store, not a read-modify-write, so it adds no such chain.

    At least _FEW_MIN 16-bit values of which the first _FEW_SAMPLE hold at most _FEW
    distinct ones take `_count_few`: one 32-lane compare and popcount per distinct value of
    the sample, the table only for values outside it: faster than the table on +-1-ULP
    deltas, as xor and much more so as add, and on the small records of a
    mixture-of-experts refit."""
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
    Searching the values found one at a time for each sampled value cost a mispredicted
    exit a value, several times this way's time."""
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
    sum c * log2(m / c). `wire.values.entropy_bits` for any counts."""
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
    room for min(add.size, 2**width) entries. One call instead of two histograms and two
    entropies in numpy, whose per-record overhead op "auto"'s sampled choice felt."""
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
