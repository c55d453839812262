"""Unsigned LEB128 varints, as every section writes its integers (docs/wire-format.md,
"Varints"), and `Reader`, the bounds-checked cursor the section parsers read with.

Varints are canonical: at most 10 bytes, no bits above bit 63, and no redundant trailing
0x00 byte; decoding rejects anything else with a `PositionsError`. Encoding and decoding
take one compiled pass (nemo_dcr.kernels.varints), or numpy vectorised over the values:
its only Python loops run over the (at most 10) byte positions of a varint.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from .errors import PositionsError

_U64 = np.uint64
MAX_VARINT_BYTES = 10  # ceil(64 / 7)


def leb128_ints(*values: int) -> bytes:
    """Unsigned LEB128 of a few Python ints, concatenated: `leb128_encode` without an array
    (a section's shift or table sizes, where building an array cost ten times as much)."""
    out = bytearray()
    for v in values:
        if v < 0:
            raise ValueError(f"LEB128 of a negative value {v}")
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def leb128_encode(values: np.ndarray) -> np.ndarray:
    """Unsigned LEB128 of each uint64 in `values`, concatenated, as a uint8 array."""
    x = values if type(values) is np.ndarray and values.dtype == _U64 and values.flags.c_contiguous \
        else np.ascontiguousarray(values, dtype=_U64)
    if x.size == 0:
        return np.empty(0, dtype=np.uint8)
    if kernels.common.HAVE_NUMBA:  # one compiled pass, the same bytes
        out = np.empty(MAX_VARINT_BYTES * x.size, dtype=np.uint8)
        return out[:kernels.varints.leb128(x, out)]
    # Bytes per value: 1 + number of 7-bit thresholds the value reaches.
    nbytes = np.ones(x.shape, dtype=np.int64)
    for k in range(1, MAX_VARINT_BYTES):
        nbytes += x >= _U64(1 << (7 * k))
    starts = np.cumsum(nbytes) - nbytes
    out = np.empty(int(nbytes.sum()), dtype=np.uint8)
    for k in range(MAX_VARINT_BYTES):
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
    if kernels.common.HAVE_NUMBA:  # one compiled pass; on a bad varint the numpy checks below name it
        out = np.empty(b.size, dtype=_U64)
        k, end = kernels.varints.leb128_parse(b, 0, b.size, out)
        if k >= 0 and end == b.size:
            return out[:k]
    if b[-1] & 0x80:
        raise PositionsError("varint stream ends inside a varint (truncated)")
    ends = np.flatnonzero((b & 0x80) == 0)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > MAX_VARINT_BYTES:
        raise PositionsError(f"varint longer than {MAX_VARINT_BYTES} bytes")
    if np.any((lengths > 1) & (b[ends] == 0)):
        raise PositionsError("non-minimal varint encoding")
    tenth = lengths == MAX_VARINT_BYTES
    if np.any(b[ends[tenth]] > 1):
        raise PositionsError("varint overflows 64 bits")
    out = np.zeros(ends.shape, dtype=_U64)
    for k in range(MAX_VARINT_BYTES):
        sel = lengths > k
        if not sel.any():
            break
        chunk = (b[starts[sel] + k] & 0x7F).astype(_U64)
        out[sel] |= chunk << _U64(7 * k)
    return out


class Reader:
    """Bounds-checked cursor over a raw section; every short read is a PositionsError."""

    def __init__(self, raw: bytes | memoryview | np.ndarray):
        self.buf = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
        self.pos = 0

    @property
    def left(self) -> int:
        return int(self.buf.size - self.pos)

    def varints(self, n: int, what: str) -> np.ndarray:
        if n < 0 or n > self.left:  # every varint is at least one byte
            raise PositionsError(f"{what}: {n} varints cannot fit in {self.left} bytes")
        if n == 0:
            return np.empty(0, dtype=_U64)
        if kernels.common.HAVE_NUMBA:  # one compiled pass (most calls read one varint); errors: below
            out = np.empty(n, dtype=_U64)
            k, end = kernels.varints.leb128_parse(self.buf, self.pos, n, out)
            if k == n:
                self.pos = int(end)
                return out
        window = self.buf[self.pos:self.pos + min(self.left, MAX_VARINT_BYTES * n)]
        ends = np.flatnonzero((window & 0x80) == 0)
        if ends.size < n:
            raise PositionsError(f"{what}: truncated varints")
        stop = int(ends[n - 1]) + 1
        vals = leb128_decode(window[:stop])
        self.pos += stop
        return vals

    def varint(self, what: str, hi: int) -> int:
        pos = self.pos
        if pos < self.buf.size and self.buf[pos] < 0x80:  # one byte, most of them: no compiled call
            v = int(self.buf[pos])
            self.pos = pos + 1
        else:
            v = int(self.varints(1, what)[0])
        if v > hi:
            raise PositionsError(f"{what}: {v} out of range (max {hi})")
        return v

    def take(self, n: int, what: str) -> np.ndarray:
        if n < 0 or n > self.left:
            raise PositionsError(f"{what}: needs {n} bytes, {self.left} left (truncated)")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def done(self, what: str) -> None:
        if self.left:
            raise PositionsError(f"{what}: {self.left} trailing bytes")
