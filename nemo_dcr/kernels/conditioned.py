"""Baseline-conditioned coding's compiled passes (nemo_dcr.wire.conditioned): the classes
of a record's universe read from the old bits both ends hold, each class's change mask as
Golomb-coded gaps, and the values as one rANS stream whose table is picked by the change's
class group.

Kernels never raise: decoders return a negative status (see the wire module for what each
means), encoders are handed buffers sized from bounds the wire module computes.
"""

from __future__ import annotations

import numpy as np

from .common import _jit, _jit_inline


SCALE_BITS = 14
SCALE = 1 << SCALE_BITS
RANS_L = 1 << 16  # the state lives in [RANS_L, 2**32); 16-bit words renormalise it
ALPHABET = 256  # value symbols: 0..254 literal, 255 escapes to the raw 16-bit value
ESCAPE = ALPHABET - 1
_NEVER = np.int64(1) << 62  # more elements than any universe holds


@_jit
def class_ranks(base, lo, pos, shift, cmask, cls_out, gap_out, totals):
    """One pass over the universe's old bits `base` (its element i is canonical position
    lo + i): per change j (positions `pos`, strictly increasing), its class
    (base >> shift) & cmask and its gap -- the number of unchanged elements of that class
    since the class's previous change (or the universe's start). `totals` (zeroed, one per
    class) ends holding each class's element count. Returns the changes placed: pos.size
    unless a position is out of order or outside the universe."""
    k = pos.size
    n = base.size
    last = np.full(totals.size, -1, np.int64)
    j = 0
    nxt = np.int64(pos[0]) - lo if k > 0 else np.int64(-1)
    for i in range(n):
        c = (np.int64(base[i]) >> shift) & cmask
        if i == nxt:
            cls_out[j] = c
            gap_out[j] = totals[c] - last[c] - 1
            last[c] = totals[c]
            j += 1
            nxt = np.int64(pos[j]) - lo if j < k else np.int64(-1)
        totals[c] += 1
    return j


@_jit_inline
def _put_bits(buf, at, value, nbits):
    """Write the low `nbits` of value MSB first at bit offset `at`; returns the new offset."""
    for b in range(nbits - 1, -1, -1):
        if (value >> b) & 1:
            buf[at >> 3] |= np.uint8(0x80 >> (at & 7))
        at += 1
    return at


@_jit_inline
def _bit_width(mc):
    """Bits of a truncated-binary remainder below mc: ceil(log2 mc)."""
    b = 0
    while (np.int64(1) << b) < mc:
        b += 1
    return b


@_jit_inline
def _remainder_widths(m):
    """Per class, the truncated-binary remainder's width b and threshold u = 2**b - m."""
    bw = np.zeros(m.size, np.int64)
    uu = np.zeros(m.size, np.int64)
    for c in range(m.size):
        bw[c] = _bit_width(m[c]) if m[c] > 0 else 0
        uu[c] = (np.int64(1) << bw[c]) - m[c]
    return bw, uu


@_jit
def golomb_write(gaps, cls, m, at, buf, write):
    """Each class's gaps as one Golomb stream (m[c] per class: the quotient in unary, ones
    closed by a zero, the remainder in truncated binary; m 0: no bits), class c's written
    from bit at[c] of `buf` (zeroed), each class at its own cursor as the changes come in
    position order; `at` ends past each class's last bit. With write False nothing is
    written: `at` (zeros) ends holding each class's bits."""
    bw, uu = _remainder_widths(m)
    for j in range(gaps.size):
        c = cls[j]
        if m[c] == 0:
            continue
        q, rv, rb = _golomb_code(gaps[j], m[c], bw[c], uu[c])
        a = at[c]
        if not write:
            at[c] = a + q + 1 + rb
            continue
        for _ in range(q):
            buf[a >> 3] |= np.uint8(0x80 >> (a & 7))
            a += 1
        at[c] = _put_bits(buf, a + 1, rv, rb)  # after the zero that ends the unary


@_jit_inline
def _golomb_code(g, mc, b, u):
    """(quotient, remainder code, its bits) of gap g with parameter mc >= 1 (b, u: _remainder_widths)."""
    q = g // mc
    if mc == 1:
        return q, np.int64(0), np.int64(0)
    r = g - q * mc
    if r < u:
        return q, r, np.int64(b - 1)
    return q, r + u, np.int64(b)


@_jit_inline
def _get_bit(buf, at, end_bit):
    if at >= end_bit:
        return -1
    return (buf[at >> 3] >> (7 - (at & 7))) & 1


@_jit_inline
def _golomb_read(buf, bitpos, end_bit, mc, b, u):
    """(gap, new bit offset); gap -1 when the stream ends first. mc 0: every gap is 0."""
    if mc == 0:
        return np.int64(0), bitpos
    q = np.int64(0)
    at = bitpos
    while True:
        if at >= end_bit:
            return np.int64(-1), at
        bit = (buf[at >> 3] >> (7 - (at & 7))) & 1
        at += 1
        if bit == 0:
            break
        q += 1
    r = np.int64(0)
    if mc > 1:
        if at + b - 1 > end_bit:
            return np.int64(-1), at
        for _ in range(b - 1):
            r = (r << 1) | ((buf[at >> 3] >> (7 - (at & 7))) & 1)
            at += 1
        if r >= u:
            if at >= end_bit:
                return np.int64(-1), at
            r = ((r << 1) | ((buf[at >> 3] >> (7 - (at & 7))) & 1)) - u
            at += 1
    return q * mc + r, at


@_jit
def golomb_positions(base, lo, shift, cmask, counts, m, start_byte, end_byte, buf, pos_out, cls_out):
    """The decoder's pass over the universe: an element is a change when its class's
    pending gap is used up. counts[c]: the class's changes (m, start_byte, end_byte as the
    encoder wrote them). Returns the changes found, or -1 when a stream ends early or
    holds bits past its last gap, -2 when a class has more changes than elements here (a
    baseline that is not the producer's, or a malformed section)."""
    ncls = counts.size
    left = counts.copy()
    # due[c]: elements of class c still to pass before its next change; _NEVER once none is
    # left (counting down from it never reaches 0), so the hot loop has one load and one test.
    due = np.full(ncls, _NEVER, np.int64)
    bitpos = np.zeros(ncls, np.int64)
    bw = np.zeros(ncls, np.int64)
    uu = np.zeros(ncls, np.int64)
    for c in range(ncls):
        if left[c] > 0:
            bw[c] = _bit_width(m[c])
            uu[c] = (np.int64(1) << bw[c]) - m[c]
            bitpos[c] = start_byte[c] << 3
            g, at = _golomb_read(buf, bitpos[c], end_byte[c] << 3, m[c], bw[c], uu[c])
            if g < 0:
                return -1
            due[c] = g
            bitpos[c] = at
    j = 0
    for i in range(base.size):
        c = (np.int64(base[i]) >> shift) & cmask
        d = due[c]
        if d != 0:
            due[c] = d - 1
            continue
        pos_out[j] = lo + i
        cls_out[j] = c
        j += 1
        left[c] -= 1
        if left[c] > 0:
            g, at = _golomb_read(buf, bitpos[c], end_byte[c] << 3, m[c], bw[c], uu[c])
            if g < 0:
                return -1
            due[c] = g
            bitpos[c] = at
        else:
            due[c] = _NEVER
    for c in range(ncls):
        if left[c] > 0:
            return -2
        if counts[c] > 0:
            # Only zero padding may follow the last gap, within its byte.
            if (bitpos[c] + 7) >> 3 != end_byte[c]:
                return -1
            at = bitpos[c]
            while at < (end_byte[c] << 3):
                if (buf[at >> 3] >> (7 - (at & 7))) & 1:
                    return -1
                at += 1
    return j


@_jit
def value_symbols(vals, add, sym_out):
    """Symbols of 16-bit values: add values as the zigzag of their signed view, xor values
    as they are; ESCAPE for a symbol >= ESCAPE. Returns how many escaped."""
    esc = 0
    for j in range(vals.size):
        v = np.int64(vals[j])
        if add:
            s = v - 65536 if v >= 32768 else v
            z = (s << 1) if s >= 0 else ((-s) << 1) - 1
        else:
            z = v
        if z >= ESCAPE:
            sym_out[j] = ESCAPE
            esc += 1
        else:
            sym_out[j] = z
    return esc


@_jit
def symbol_counts(sym, cls, out):
    """out[c, s] += 1 per change of class c with symbol s."""
    for j in range(sym.size):
        out[cls[j], sym[j]] += 1


@_jit
def rans_encode(sym, cls, group_of, freq, cum, words):
    """One rANS stream of the symbols, back to front, the table of the change's class group
    (freq/cum: one row per group, summing to SCALE); words ends with the state at the
    front. Returns the index of the first word written (words[first:] is the stream)."""
    x = np.uint64(RANS_L)
    p = words.size
    for j in range(sym.size - 1, -1, -1):
        g = group_of[cls[j]]
        s = sym[j]
        f = np.uint64(freq[g, s])
        xmax = f << np.uint64(32 - SCALE_BITS)
        if x >= xmax:
            p -= 1
            words[p] = np.uint16(x & np.uint64(0xFFFF))
            x >>= np.uint64(16)
        x = ((x // f) << np.uint64(SCALE_BITS)) + (x % f) + np.uint64(cum[g, s])
    p -= 1
    words[p] = np.uint16(x & np.uint64(0xFFFF))
    p -= 1
    words[p] = np.uint16(x >> np.uint64(16))
    return p


@_jit
def rans_decode(words, cls, group_of, freq, cum, lookup, sym_out):
    """The symbols of rans_encode's stream. Returns 0, or -1 when the stream is too short,
    too long, or does not end in the encoder's start state."""
    nw = words.size
    if nw < 2:
        return -1
    x = (np.uint64(words[0]) << np.uint64(16)) | np.uint64(words[1])
    if x < np.uint64(RANS_L):
        return -1
    p = 2
    mask = np.uint64(SCALE - 1)
    for j in range(sym_out.size):
        g = group_of[cls[j]]
        slot = x & mask
        s = lookup[g, slot]
        x = np.uint64(freq[g, s]) * (x >> np.uint64(SCALE_BITS)) + slot - np.uint64(cum[g, s])
        if x < np.uint64(RANS_L):
            if p >= nw:
                return -1
            x = (x << np.uint64(16)) | np.uint64(words[p])
            p += 1
        sym_out[j] = s
    if p != nw or x != np.uint64(RANS_L):
        return -1
    return 0


@_jit
def value_bits(sym, raw, add, out):
    """16-bit values of the symbols (`raw`: the escaped symbols' values, in order). Returns
    the raw values used, or -1 when an escaped value is one a literal codes."""
    e = 0
    for j in range(sym.size):
        s = np.int64(sym[j])
        if s == ESCAPE:
            if e >= raw.size:
                return -1
            s = np.int64(raw[e])
            e += 1
            if s < ESCAPE:
                return -1
        if add:
            v = (s >> 1) if (s & 1) == 0 else -((s + 1) >> 1)
            out[j] = np.uint16(v & 0xFFFF)
        else:
            out[j] = np.uint16(s)
    return e


@_jit
def escaped_values(vals, add, sym, raw_out):
    """The raw 16-bit symbol values of the escaped changes, in order."""
    e = 0
    for j in range(vals.size):
        if sym[j] == ESCAPE:
            v = np.int64(vals[j])
            if add:
                s = v - 65536 if v >= 32768 else v
                raw_out[e] = (s << 1) if s >= 0 else ((-s) << 1) - 1
            else:
                raw_out[e] = v
            e += 1
    return e
