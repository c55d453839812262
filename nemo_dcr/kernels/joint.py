"""The joint rANS stream of format v5 (docs/wire-format.md, "Joint stream"): a record's gap
quotients and value symbols as one symbol per change, four interleaved states, a model that
is the product of the two sent (nemo_dcr.wire.joint)."""

from __future__ import annotations

import numpy as np

from .common import _jit, _jit_inline
from .intrinsics import _be64
from .rans import (_encode_finish, _encode_step, _exclusive_sums, _four_start_states, PROB_BITS, PROB_SCALE, RANS_L,
                   _rans_tables)


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
    log2 f each; symbols that do not occur cost nothing). One compiled loop instead of
    numpy's masks and log, called three times a joint record."""
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
    """A joint stream's model, or why not (`wire.joint.encode_joint`), in one compiled call:
    0 when the values' stream would take more than `value_bits` bits (model_bits), when
    the product model (`rans_product_model`, into int64 `freq`) has fewer than two cells,
    or when its estimated rounding (`joint_excess_bits`) exceeds `max_excess` of the two
    streams' bits; else 1, with cum the product's exclusive prefix sums. The same
    decisions and model as those calls one by one, without their per-call overhead."""
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
    x0, x1, x2, x3 = _four_start_states()
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
    the values' table of 8- or 16-bit values). Two forms (`wire.joint.decode_joint` picks one
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
