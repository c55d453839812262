"""The rANS coder (docs/wire-format.md, "rANS streams"): two interleaved 32-bit states kept
in [2**16, 2**32), 16-bit renormalisation words, probabilities quantised to 2**16.

The encoder divides by a reciprocal multiply (exact, see `_rans_tables`) and can code a
record's two streams (positions and values, the same length) in one pass (`rans_encode2`);
the words are those of `rans_encode`, stream by stream.
"""

from __future__ import annotations

import numpy as np

from .common import _jit, _jit_inline
from .intrinsics import _mulhi


PROB_BITS = 16
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 16  # lower bound of the state; also the state the encoder starts from


_QUANTIZE_MAX_SUM = 1 << 46  # counts summing below this quantise here (c << 16 stays in int64)


@_jit
def rans_model(counts, freq, cum):
    """A stream's model from int64 symbol counts in one compiled call: the number of
    symbols that occur, or -1 when the counts need `wire.rans.quantize`'s general path (a
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


@_jit_inline
def _four_start_states():
    """Four encoder states at their start (RANS_L): the set-up of the four-way interleaved
    encoders (`rans_encode2`, `joint.rans_encode_joint`); inlined, so they stay registers."""
    x = np.uint64(RANS_L)
    return x, x, x, x


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
    x0, x1, y0, y1 = _four_start_states()
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
    every one of the sum(freq) slots (slot2sym's size). One compiled call instead of
    numpy's prefix sum, range and repeat, whose call overhead a small record (two streams)
    felt."""
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
