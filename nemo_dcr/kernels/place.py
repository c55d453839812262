"""Placement: local flat indices of a training shard to canonical flat indices through an
affine piece (nemo_dcr.placement)."""

from __future__ import annotations

import numpy as np

from .common import _jit


_AFFINE_EXACT = 1 << 50  # affine_index's double-precision rows are exact below this offset
_AFFINE_NARROW = 1 << 31  # offsets below this take affine_index's multiply-shift rows


@_jit
def affine_index(local, local_start, cols, offset, row_stride, out):
    """out[i] = offset + r * row_stride + c, (r, c) = divmod(local[i] - local_start, cols).

    Offsets rel = local[i] - local_start in [0, 2**31), with row_stride >= cols (every
    monotone piece) and both below 2**31: the row is (rel * m) >> (31 + l), l = ceil(log2
    cols), m = ceil(2**(31 + l) / cols) < 2**32, exact for every 31-bit rel (Granlund and
    Montgomery's round-up method), and every multiply is 32 x 32 -> 64 bits, which the
    vectorised loop does eight to a 512-bit register (about twice as fast as the
    double-precision row below, which needs 64-bit multiplies that AVX-512 does slowly).
    Anything else, or an offset out of that range (checked on the way), takes
    `_affine_index_wide`: a call whose positions reach 2**31 past the piece's start (a piece
    of more than 2**31 elements) pays both loops; splitting the check into blocks cost the
    vectorised loop 4x and was not kept."""
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
