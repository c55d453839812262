"""Gaps of sorted positions: the order check, the Rice shift, the split of gaps into quotient
symbols, low bits and escapes, and their join back into positions (docs/wire-format.md,
"Gaps")."""

from __future__ import annotations

import numpy as np

from .common import _jit, _jit_inline
from .intrinsics import _ctz64, _eq_mask, _ge_mask, _popcount, _store_be64


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


_RICE_BLOCKS, _RICE_RUN = 64, 64  # rice_shift's sample of a long record: 2**12 gaps
_INT64_MAX = (1 << 63) - 1


@_jit
def rice_shift(p, cap):
    """Rice shift r for the sorted int64 positions p (0 when empty), quotient symbols capped at
    `cap`: the best of three shifts around log2(mean gap) by estimated size (order-0
    entropy of the capped quotients + r raw bits per gap + 24 bits per escape), on at most
    2**13 gaps: all of them (g_0 = p[0]) below 2**13 positions, else _RICE_BLOCKS runs of
    _RICE_RUN consecutive gaps evenly spread (runs, not single gaps: each takes a few cache
    lines where lone gaps missed the cache every time). With 2**12 sampled gaps instead of
    2**14 the payloads of benchmarks/trainer_speed.py and codec.py came out -0.14% to +0.02%
    a row, for about a third of the time a record. Negative
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

    Three passes, together faster than one loop doing all of it: the symbols, order check
    and counts of zero and escaped gaps (no state carried from gap to gap: the loop
    vectorises), and for shifts of 1-8 each gap's low bits as a byte; the symbols' counts
    (`_count_symbols`: 64 at a time by byte compares); the low bits packed
    (`_pack_low_bytes` from those bytes, eight gaps a step, else `_pack_low_bits` from the
    positions), faster than the same passes counting one symbol and packing one gap at a
    time. The escapes' excesses (`_excesses`) and the first bad position (an error:
    `strictly_increasing_below`) take a pass of their own when there are any."""
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
    every gap again cost about a quarter of the split."""
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
    carried from step to step: faster than the positions' loop for r = 1-8. The last steps,
    whose store would pass the end of `low`, and the last n % 8 gaps take the bit loop.
    Returns the bytes written."""
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
