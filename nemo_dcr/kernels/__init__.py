"""Compiled single-pass kernels: the trainer's diff and placement, the receiver's sparse
apply, and the wire format's coders (v5's rANS streams and joint stream, v6's prefix-stream
decoder), one module per subsystem:

    common      the numba switch and the decorators (`jit`, `jit_inline`)
    intrinsics  LLVM stand-ins for what numba cannot spell (vector compares, prefetch, ...)
    diff        changed positions and values of a shard against its baseline
    place       local to canonical flat indices (affine pieces)
    varints     LEB128 varints, `runs` varints, stream models
    gaps        the order check, Rice shift, gap split and join
    rans        the two-state rANS coder
    joint       v5's joint stream (four states, product model)
    prefix      v6's prefix-stream decoder
    values      value histograms, entropies, symbol lookups
    scatter     the receiver's sparse apply

Callers import the package and name the module: `kernels.rans.rans_encode(...)`. Compiled
code outside the package imports what it calls by name (numba resolves globals, not
attribute chains): `from nemo_dcr.kernels.common import jit`.

Everything here is plain Python over numpy arrays, written so that numba can compile it
(`numba.njit`). With numba installed (a dependency, see pyproject.toml) the kernels run
compiled; without it, or with NEMO_DCR_NO_NUMBA=1, the very same functions run as Python.
Callers pick a vectorised numpy path instead where one exists (the diff, the placement);
the entropy coder has none, so without numba it runs these functions as Python (correct and
bit-identical, but ~100x slower). Either way the output bits are the same: the code is the
same.

Kernels never raise on bad input: decoders return a negative status and the caller turns it
into `PositionsError` (so `PayloadRejected`). Numba does not bounds-check array accesses, so
every index a decoder derives from input data is checked explicitly.
"""

from . import common, diff, gaps, intrinsics, joint, place, prefix, rans, scatter, values, varints

__all__ = ["common", "diff", "gaps", "intrinsics", "joint", "place", "prefix", "rans", "scatter", "values", "varints"]
