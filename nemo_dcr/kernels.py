"""Compiled single-pass kernels for the trainer hot path and the rANS coder of format v3.

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


# ======================================================================== diff


@_jit
def diff_words(a, b, aw, bw, per, w0, pos, new, old, n0):
    """Scan int64 words aw/bw (views of a/b) from word w0; write every element of a word
    that differs into (pos, new, old) from slot n0, keeping only the changed ones.

    Branch-free, in blocks of 512 words: the indices of differing words are compacted
    first (a store per word, the count advanced by the compare), then their elements
    are written with the slot advanced by the element compare - no unpredictable branch
    per word or element. Returns (n, w): the slots used and the next word to scan
    (< len(aw) when the output buffers were full; call again with larger buffers)."""
    nw = aw.size
    cap = pos.size
    n = n0
    wbuf = np.empty(512, np.int64)
    blk = w0
    while blk < nw:
        end = min(blk + 512, nw)
        nd = 0
        for w in range(blk, end):
            wbuf[nd] = w
            nd += np.int64(aw[w] != bw[w])
        if n + nd * per > cap:
            return n, blk
        for k in range(nd):
            base = wbuf[k] * per
            for j in range(per):
                x = a[base + j]
                y = b[base + j]
                pos[n] = base + j
                new[n] = x
                old[n] = y
                n += np.int64(x != y)
        blk = end
    return n, nw


# ======================================================================== placement


@_jit
def affine_index(local, local_start, cols, offset, row_stride, out):
    """out[i] = offset + r * row_stride + c, (r, c) = divmod(local[i] - local_start, cols).

    One division per block row touched when `local` is sorted (any order is correct)."""
    row_lo = 0
    row_hi = -1
    base = 0
    for i in range(local.size):
        rel = local[i] - local_start
        if rel >= row_hi or rel < row_lo:
            row = rel // cols
            row_lo = row * cols
            row_hi = row_lo + cols
            base = offset + row * row_stride - row_lo
        out[i] = base + rel


@_jit
def strictly_increasing_below(p, max_pos):
    """0 if int64 positions p are >= 0, strictly increasing and <= max_pos; else 1 + index
    of the first offender (with -1 meaning p[-1] > max_pos)."""
    prev = -1
    for i in range(p.size):
        v = p[i]
        if v <= prev:
            return i + 1
        prev = v
    if p.size and prev > max_pos:
        return -1
    return 0


# ======================================================================== gaps


@_jit
def gaps_split(p, r, esc, sym, counts, low, excess):
    """Gaps of sorted int64 positions, split by the Rice shift r.

    sym[i] = min(g_i >> r, esc), counts[s] += 1, the r low bits of every gap packed MSB
    first into `low` (zero-padded to a byte), excess[k] = (g >> r) - esc for the k-th
    escaped gap. p must be validated (>= 0, strictly increasing). Returns (low bytes
    written, escapes, gaps equal to 0 after the first)."""
    prev = -1
    acc = 0  # pending bits, fewer than 8 between gaps
    nbits = 0
    nb = 0
    ne = 0
    zeros = 0
    for i in range(p.size):
        v = p[i]
        g = v - prev - 1
        prev = v
        if g == 0:
            zeros += 1
        q = g >> r
        if q >= esc:
            sym[i] = esc
            counts[esc] += 1
            excess[ne] = q - esc
            ne += 1
        else:
            sym[i] = q
            counts[q] += 1
        if r:
            left = r
            while left > 0:
                take = left if left <= 48 else 48
                left -= take
                acc = (acc << take) | ((g >> left) & ((1 << take) - 1))
                nbits += take
                while nbits >= 8:
                    nbits -= 8
                    low[nb] = (acc >> nbits) & 0xFF
                    nb += 1
                acc &= (1 << nbits) - 1
    if nbits:
        low[nb] = (acc << (8 - nbits)) & 0xFF
        nb += 1
    if p.size and p[0] == 0:
        zeros -= 1
    return nb, ne, zeros


@_jit
def gaps_join(sym, esc, r, low, excess, max_pos, out):
    """Inverse of gaps_split with every check: positions into int64 `out`, each <= max_pos
    (numel - 1, so that numel = 2**63 fits an int64). esc < 0: no escape symbol.

    Returns 0, or -1 truncated low bits, -2 non-zero padding, -3 escapes count mismatch,
    -4 gap beyond 2**63, -5 position > max_pos."""
    m = sym.size
    nlow = low.size
    if r and (m * r + 7) // 8 != nlow:
        return -1
    big = (1 << 63) - 1
    prev = -1
    bitpos = 0
    ne = 0
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
        if r:
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
    # padding bits after the last gap must be zero
    while bitpos < 8 * nlow:
        if (np.int64(low[bitpos >> 3]) >> (7 - (bitpos & 7))) & 1:
            return -2
        bitpos += 1
    return 0


# ======================================================================== rANS


@_jit
def rans_encode(sym, freq, cum, out):
    """Two-way interleaved rANS: symbol i is coded by state i % 2.

    Encodes in reverse, writing 16-bit words backwards into `out` (size >= len(sym) + 4);
    returns the index of the first word, so the stream is out[i:]: the four words of
    the final states (x0 low, x0 high, x1 low, x1 high), then the renormalisation words
    in the order the decoder reads them. freq: quantised frequencies (sum 2**16, every
    coded symbol's >= 1 and < 2**16); cum: their exclusive prefix sums.

    One step per symbol on `xa`, the state of the symbol at hand; the two states swap
    after every symbol, so they alternate and their division chains still overlap."""
    u16 = np.uint32(16)
    xa = np.uint32(RANS_L)
    xb = np.uint32(RANS_L)
    p = out.size
    for i in range(sym.size - 1, -1, -1):
        s = sym[i]
        f = np.uint32(freq[s])
        if xa >= (f << u16):
            p -= 1
            out[p] = xa & np.uint32(0xFFFF)
            xa = xa >> u16
        q = xa // f
        xa = (q << u16) + (xa - q * f) + np.uint32(cum[s])
        xa, xb = xb, xa
    x0, x1 = xb, xa  # the last symbol coded, index 0, was state 0's
    out[p - 1] = x1 >> u16
    out[p - 2] = x1 & np.uint32(0xFFFF)
    out[p - 3] = x0 >> u16
    out[p - 4] = x0 & np.uint32(0xFFFF)
    return p - 4


@_jit
def rans_decode(words, freq, cum, slot2sym, out):
    """Decode len(out) symbols of a stream written by rans_encode.

    Returns 0, or -1 bad initial states, -2 the words run out, -3 the stream does not
    end exactly where the symbols do (both states back at 2**16, every word read).
    As in rans_encode, `xa` is the state of the symbol at hand and the states swap
    after every symbol (words are read in the order the encoder wrote them)."""
    nw = words.size
    if nw < 4:
        return -1
    xa = np.int64(words[0]) | (np.int64(words[1]) << 16)
    xb = np.int64(words[2]) | (np.int64(words[3]) << 16)
    if xa < RANS_L or xb < RANS_L:
        return -1
    ptr = 4
    for i in range(out.size):
        slot = xa & 0xFFFF
        s = slot2sym[slot]
        out[i] = s
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


# ======================================================================== values


@_jit
def histogram(vals, nbins, counts):
    """counts[v] += 1 for each unsigned value (width <= 2: vals < nbins)."""
    for i in range(vals.size):
        counts[vals[i]] += 1
    return nbins


@_jit
def map_symbols(vals, lut, sym):
    for i in range(vals.size):
        sym[i] = lut[vals[i]]


@_jit
def lookup(sym, table, out):
    for i in range(sym.size):
        out[i] = table[sym[i]]


# ======================================================================== apply


@_jit
def scatter_apply(flat, pos, vals, op):
    """In place on an unsigned bit view: flat[pos] ^= vals (op 0), += vals wrapping (op 1)
    or = vals (op 2). `pos` is checked by the caller (sorted, in range)."""
    if op == 0:
        for i in range(pos.size):
            flat[pos[i]] ^= vals[i]
    elif op == 1:
        for i in range(pos.size):
            flat[pos[i]] += vals[i]
    else:
        for i in range(pos.size):
            flat[pos[i]] = vals[i]
