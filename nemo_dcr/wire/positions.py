"""Positions on the wire: sorted, strictly increasing canonical flat indices below 2**63,
their checks, and the `runs` encoding (docs/wire-format.md, "Positions"). The entropy-coded
encodings of positions are in `gaps`.

`runs`: sorted flat indices <-> run/gap varints. A record's positions are split into
maximal runs of consecutive indices and written as (gap, length) pairs, each an unsigned
LEB128 varint:

    gap_0 = start of the first run            (may be 0)
    gap_i = start_i - end_{i-1}               (>= 1: runs are maximal)
    len_i = number of indices in run i        (>= 1)

where end is exclusive. The varint stream is then zstd-compressed by the codec. Every
step here is vectorised with numpy (or one compiled pass): no Python loop runs over
elements, runs or varints.

Everything is uint64, so index spaces up to 2**63 elements are handled exactly.
Decoding raises `PositionsError` (a ValueError) with a reason; the codec turns it into
`PayloadRejected`.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from .errors import PositionsError
from .varints import MAX_VARINT_BYTES, leb128_decode, leb128_encode


# Largest number of elements a canonical tensor may have on the wire. Positions are
# therefore < 2**63 and fit a signed int64 as well (torch indexing is int64).
MAX_NUMEL = 1 << 63
_U64 = np.uint64
_U32 = np.uint32


def encode_runs(positions: np.ndarray) -> bytes:
    """Raw (uncompressed) varint stream of (gap, length) pairs for sorted positions.

    `positions` must already be validated: uint64 (or uint32), strictly increasing.
    """
    if positions.size == 0:
        return b""
    if kernels.common.HAVE_NUMBA and positions.dtype in (_U64, _U32):  # one compiled pass, the same bytes
        out = np.empty(2 * MAX_VARINT_BYTES * positions.size, np.uint8)
        return out[:kernels.varints.runs_leb128(np.ascontiguousarray(positions), out)].tobytes()
    p = np.ascontiguousarray(positions, dtype=_U64)
    # A run starts where the previous index is not exactly one less.
    brk = np.flatnonzero(np.diff(p) != _U64(1)) + 1
    first = np.concatenate(([0], brk))
    last = np.concatenate((brk - 1, [p.size - 1]))
    run_start = p[first]
    run_len = (last - first + 1).astype(_U64)
    prev_end = np.zeros_like(run_start)
    prev_end[1:] = p[last[:-1]] + _U64(1)
    pairs = np.empty(2 * run_start.size, dtype=_U64)
    pairs[0::2] = run_start - prev_end
    pairs[1::2] = run_len
    return leb128_encode(pairs).tobytes()


def decode_runs(raw: bytes | memoryview, count: int, numel: int) -> np.ndarray:
    """Positions (uint64) from a raw varint stream; validated against count and numel."""
    if count == 0:
        if len(raw) != 0:
            raise PositionsError("positions section not empty for a record with no changes")
        return np.empty(0, dtype=_U64)
    vals = leb128_decode(np.frombuffer(raw, dtype=np.uint8))
    if vals.size % 2:
        raise PositionsError("odd number of varints: (gap, length) pairs expected")
    gaps, lens = vals[0::2], vals[1::2]
    if lens.size > count:
        raise PositionsError(f"{lens.size} runs for only {count} positions")
    limit = _U64(MAX_NUMEL)
    if np.any(gaps > limit) or np.any(lens > limit):
        raise PositionsError("gap or run length beyond 2**63")
    if np.any(lens == 0):
        raise PositionsError("run of length 0")
    if np.any(gaps[1:] == 0):
        raise PositionsError("adjacent runs not merged (gap 0): non-canonical runs")
    # Exclusive run ends. Each step adds < 2**64, so a wrap-around shows up as a
    # decrease; with len >= 1 the ends must be strictly increasing anyway.
    with np.errstate(over="ignore"):
        ends = np.cumsum(gaps + lens, dtype=_U64)
    if ends.size > 1 and np.any(ends[1:] <= ends[:-1]):
        raise PositionsError("run ends overflow 64 bits")
    if int(ends[-1]) > numel:
        raise PositionsError(f"position {int(ends[-1]) - 1} >= numel {numel}")
    # The sum of lengths is <= ends[-1] <= numel <= 2**63: no overflow.
    total = int(lens.sum(dtype=_U64))
    if total != count:
        raise PositionsError(f"runs hold {total} positions, header declares count {count}")
    starts = ends - lens
    out_start = np.cumsum(lens, dtype=_U64) - lens  # where each run lands in the output
    shift = np.repeat(starts - out_start, lens.astype(np.int64))
    return np.arange(count, dtype=_U64) + shift


def signed_view(positions: np.ndarray) -> np.ndarray:
    """uint64 positions as int64 (>= 2**63 turns negative: the kernels reject it); uint32
    ones as they are (the kernels compute their gaps in int64); narrower ones (a Record
    may hold any unsigned array) copied to int64."""
    if positions.dtype == _U32:
        return positions
    if positions.dtype == _U64:
        return positions.view(np.int64)
    return positions.astype(np.int64)


def check_positions(positions: np.ndarray, numel: int) -> str | None:
    """Why `positions` is not a valid sorted, unique, in-range index array (None if ok)."""
    if positions.ndim != 1:
        return f"positions must be 1-D, got shape {positions.shape}"
    if positions.size == 0:
        return None
    if (kernels.common.HAVE_NUMBA and positions.dtype in (_U64, _U32) and positions.flags.c_contiguous
            and kernels.gaps.strictly_increasing_below(signed_view(positions), numel - 1) == 0):
        return None  # one compiled pass; on a failure the numpy checks below name it
    if np.any(positions[1:] <= positions[:-1]):
        return "positions not strictly increasing"
    if int(positions[-1]) >= numel:
        return f"position {int(positions[-1])} >= numel {numel}"
    return None
