"""Position encoding for the wire codec: sorted flat indices <-> run/gap varints.

A record's positions are strictly increasing canonical flat indices. They are split
into maximal runs of consecutive indices and written as (gap, length) pairs, each an
unsigned LEB128 varint:

    gap_0 = start of the first run            (may be 0)
    gap_i = start_i - end_{i-1}               (>= 1: runs are maximal)
    len_i = number of indices in run i        (>= 1)

where end is exclusive. The varint stream is then zstd-compressed by the codec. Every
step here is vectorised with numpy: the only Python loops run over the (at most 10)
byte positions of a varint, never over elements, runs or varints.

Everything is uint64, so index spaces up to 2**63 elements are handled exactly.
Decoding raises `PositionsError` (a ValueError) with a reason; the codec turns it into
`PayloadRejected`.
"""

from __future__ import annotations

import numpy as np

# Largest number of elements a canonical tensor may have on the wire. Positions are
# therefore < 2**63 and fit a signed int64 as well (torch indexing is int64).
MAX_NUMEL = 1 << 63

_U64 = np.uint64
_MAX_VARINT_BYTES = 10  # ceil(64 / 7)


class PositionsError(ValueError):
    """Malformed or out-of-range position data."""


# ---------------------------------------------------------------- LEB128 varints


def leb128_encode(values: np.ndarray) -> np.ndarray:
    """Unsigned LEB128 of each uint64 in `values`, concatenated, as a uint8 array."""
    x = np.ascontiguousarray(values, dtype=_U64)
    if x.size == 0:
        return np.empty(0, dtype=np.uint8)
    # Bytes per value: 1 + number of 7-bit thresholds the value reaches.
    nbytes = np.ones(x.shape, dtype=np.int64)
    for k in range(1, _MAX_VARINT_BYTES):
        nbytes += x >= _U64(1 << (7 * k))
    starts = np.cumsum(nbytes) - nbytes
    out = np.empty(int(nbytes.sum()), dtype=np.uint8)
    for k in range(_MAX_VARINT_BYTES):
        sel = nbytes > k
        if not sel.any():
            break
        chunk = (x[sel] >> _U64(7 * k)) & _U64(0x7F)
        more = (nbytes[sel] > k + 1).astype(_U64) << _U64(7)
        out[starts[sel] + k] = (chunk | more).astype(np.uint8)
    return out


def leb128_decode(buf: np.ndarray) -> np.ndarray:
    """Decode a concatenation of canonical unsigned LEB128 varints into uint64.

    Rejects a stream that ends inside a varint, varints longer than 10 bytes, values
    that overflow 64 bits, and non-minimal encodings (so each value has one encoding).
    """
    b = np.ascontiguousarray(buf, dtype=np.uint8)
    if b.size == 0:
        return np.empty(0, dtype=_U64)
    if b[-1] & 0x80:
        raise PositionsError("varint stream ends inside a varint (truncated)")
    ends = np.flatnonzero((b & 0x80) == 0)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > _MAX_VARINT_BYTES:
        raise PositionsError(f"varint longer than {_MAX_VARINT_BYTES} bytes")
    if np.any((lengths > 1) & (b[ends] == 0)):
        raise PositionsError("non-minimal varint encoding")
    tenth = lengths == _MAX_VARINT_BYTES
    if np.any(b[ends[tenth]] > 1):
        raise PositionsError("varint overflows 64 bits")
    out = np.zeros(ends.shape, dtype=_U64)
    for k in range(_MAX_VARINT_BYTES):
        sel = lengths > k
        if not sel.any():
            break
        chunk = (b[starts[sel] + k] & 0x7F).astype(_U64)
        out[sel] |= chunk << _U64(7 * k)
    return out


# ---------------------------------------------------------------- runs


def encode_runs(positions: np.ndarray) -> bytes:
    """Raw (uncompressed) varint stream of (gap, length) pairs for sorted positions.

    `positions` must already be validated: uint64, strictly increasing.
    """
    p = np.ascontiguousarray(positions, dtype=_U64)
    if p.size == 0:
        return b""
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


def check_positions(positions: np.ndarray, numel: int) -> str | None:
    """Why `positions` is not a valid sorted, unique, in-range index array (None if ok)."""
    if positions.ndim != 1:
        return f"positions must be 1-D, got shape {positions.shape}"
    if positions.size == 0:
        return None
    if np.any(positions[1:] <= positions[:-1]):
        return "positions not strictly increasing"
    if int(positions[-1]) >= numel:
        return f"position {int(positions[-1])} >= numel {numel}"
    return None
