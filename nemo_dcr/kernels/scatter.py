"""The receiver's sparse apply: xor / add / set of changes into a flat bit view, checking
the positions as it goes."""

from __future__ import annotations

import numpy as np

from .common import _jit
from .intrinsics import _prefetch


# scatter_apply prefetches the line of the change this many changes ahead. The hardware
# prefetchers follow the sorted positions' stream but not the scattered lines they point
# at. Measured: faster than none for xor, add and set, 48-96 ahead alike, 16 ahead about
# half the gain (benchmarks/results/history.md).
_SCATTER_PREFETCH = 64
# ... for scatters kept in the modules they serve (nemo_dcr.digest's)
prefetch, SCATTER_PREFETCH = _prefetch, _SCATTER_PREFETCH


@_jit
def scatter_apply(flat, pos, vals, op):
    """In place on an unsigned bit view: flat[pos] ^= vals (op 0), += vals wrapping (op 1)
    or = vals (op 2), checking the positions as it goes: int64 (uint64 ones through
    `wire.positions.signed_view`) or uint32, strictly increasing, in [0, flat.size). Returns 0,
    or 1 + the index of the first position that is not: the changes before it are
    applied, none from it on (the caller takes them back). The check adds nothing to the
    scatter's memory traffic; a pass of its own read 8 bytes a change more, a tenth or so
    of a receiver's pause (benchmarks/results/history.md)."""
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
