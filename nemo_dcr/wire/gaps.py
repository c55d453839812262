"""`gaps_rans` (docs/wire-format.md, "Gaps"): positions as gaps, each split by a Rice shift
into a quotient symbol, rANS-coded, and raw low bits; a quotient of 255 escapes to a varint.
`gaps_joint` takes the same split and reader (`GapsParts`, `GapsReader`), its quotients coded
with the values (`joint`); `gaps_prefix` splits the gaps by the same rule on the device that
holds them (`prefix`).
"""

from __future__ import annotations

import threading

import numpy as np

from .. import kernels
from .errors import PositionsError
from .positions import MAX_NUMEL, signed_view
from .rans import RansStream, encode_rans_chunks, read_model
from .varints import Reader, leb128_encode, leb128_ints

_U64 = np.uint64

_SYMBOL_CAP_POSITIONS = 256  # quotient alphabet of `gaps_rans` (the last symbol escapes)


def encode_gaps_rans(positions: np.ndarray) -> tuple[bytes, int]:
    """Raw `gaps_rans` section for sorted, validated positions (count >= 1), and the
    number of later gaps equal to 0 (positions adjacent to the previous one).

        varint r                     Rice shift, 0..63
        rANS stream                  quotients min(g >> r, 255) of the gaps, A <= 256
        ceil(count*r/8) bytes        the r low bits of every gap, MSB first, zero-padded
        varints                      for each quotient symbol 255: (g >> r) - 255

    with g_0 = p_0, g_i = p_i - p_(i-1) - 1."""
    parts = gaps_parts(positions)
    if parts is None:
        raise ValueError("positions not strictly increasing")
    return b"".join(parts.chunks(encode_rans_chunks(parts.sym, parts.counts))), parts.zeros


class GapsParts:
    """A `gaps_rans` section before its rANS stream is coded (see `gaps_parts`), so that
    the codec can code it together with the values' stream (`encode_rans_pair`)."""

    __slots__ = ("shift", "sym", "counts", "low", "excess", "zeros")

    def __init__(self, shift, sym, counts, low, excess, zeros):
        self.shift, self.sym, self.counts, self.low, self.excess, self.zeros = shift, sym, counts, low, excess, zeros

    def chunks(self, rans: list) -> list:
        """The raw section as chunks, given encode_rans_chunks(self.sym, self.counts)."""
        out = [leb128_ints(self.shift), *rans, self.low]
        if self.excess.size:
            out.append(leb128_encode(self.excess.astype(_U64)).tobytes())
        return out


_SCRATCH = threading.local()  # per thread: the byte buffer that gaps_parts(reuse=True) hands out
_SCRATCH_CAP = 1 << 25  # bytes; larger splits allocate their own (a buffer is held for the thread's life)


def _scratch(nbytes: int) -> np.ndarray:
    """nbytes of this thread's scratch (grown as needed), or fresh memory above _SCRATCH_CAP.

    Why: a split's symbols and low-bit bytes live only until the record is coded, and
    fresh memory for them costs a page fault per 4 KiB on first touch; reused memory is
    warm."""
    if nbytes > _SCRATCH_CAP:
        return np.empty(nbytes, np.uint8)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _SCRATCH.buf = np.empty(max(nbytes, 2 * (0 if buf is None else buf.size)), np.uint8)
    return buf[:nbytes]


def gaps_parts(positions: np.ndarray, reuse: bool = False) -> GapsParts | None:
    """Rice shift, quotient symbols and their counts, packed low bits and escaped
    quotients of sorted uint64 (or uint32) positions (count >= 1): `encode_gaps_rans`
    without the rANS stream. None when the positions are not strictly increasing (or one
    is >= 2**63): the split checks that as it goes, so a caller need not check the order
    first (the upper bound, the last position, is the caller's).

    reuse: the symbols (`sym`) and the split's low-bit bytes live in this thread's
    scratch: `sym` is valid only until the thread's next gaps_parts(reuse=True), for a
    caller that codes it before then (the codec does)."""
    p = signed_view(np.ascontiguousarray(positions))
    n = p.size
    r = kernels.gaps.rice_shift(p, _SYMBOL_CAP_POSITIONS - 1)  # on a sample; one compiled pass or two
    esc = _SYMBOL_CAP_POSITIONS - 1
    words = -(-n // 8) * 8  # the split writes the low bits as bytes in whole uint64 words
    nlows = words if 1 <= r <= 8 else 0
    buf = _scratch(words + nlows) if reuse else np.empty(words + nlows, np.uint8)
    sym, lows = buf[:n], buf[words:words + nlows]
    counts = np.zeros(_SYMBOL_CAP_POSITIONS, np.int64)
    low = np.empty((n * r + 7) // 8, np.uint8)
    excess = np.empty(n, np.int64)
    nb, ne, zeros, bad = kernels.gaps.gaps_split(p, r, esc, sym, counts, low, excess, lows)
    if bad:
        return None
    alphabet = int((counts != 0).nonzero()[0][-1]) + 1
    return GapsParts(r, sym, counts[:alphabet], low[:nb], excess[:ne], int(zeros))


def decode_gaps_rans(raw: bytes | memoryview, count: int, numel: int) -> np.ndarray:
    """Positions (uint64) from a raw `gaps_rans` section; validated against count and numel."""
    g = GapsReader(raw, count)
    return g.positions(g.stream.decode(count), numel)


class GapsReader:
    """A `gaps_rans` section read up to its rANS stream's symbols (`RansStream`), so that
    the codec can decode them together with the values' stream (`decode_rans_pair`);
    `positions` then checks and joins the rest (or, for a joint stream whose gaps the
    decoder joined itself, `joined` adds the escapes' excesses and checks)."""

    __slots__ = ("rd", "count", "shift", "stream", "alphabet", "model", "words")

    def __init__(self, raw: bytes | memoryview, count: int, joint: bool = False):
        """joint: a `gaps_joint` section (v5), whose rANS stream is the quotients' model
        followed by the words of the record's joint stream (`nemo_dcr.wire.joint`): `model`
        and `words` are read, `stream` is None."""
        if count == 0:
            raise PositionsError("a 'gaps_rans' section needs at least one position")
        self.rd = Reader(raw)
        self.count = count
        self.shift = self.rd.varint("gaps shift", 63)
        if joint:
            self.stream = None
            self.model = read_model(self.rd, _SYMBOL_CAP_POSITIONS, "gaps quotients")
            nwords = self.rd.varint("joint stream word count", self.rd.left // 2)
            self.words = self.rd.take(2 * nwords, "joint stream words").view("<u2")
            self.alphabet = self.model.size
        else:
            self.stream = RansStream.read(self.rd, _SYMBOL_CAP_POSITIONS, "gaps quotients", np.uint8)
            self.alphabet, self.model, self.words = self.stream.alphabet, None, None

    @property
    def escape(self) -> int:
        """The quotients' escape symbol (its gap's excess follows the low bits), or -1 where
        the alphabet is below the cap and has none."""
        return _SYMBOL_CAP_POSITIONS - 1 if self.alphabet == _SYMBOL_CAP_POSITIONS else -1

    def positions(self, sym: np.ndarray, numel: int) -> np.ndarray:
        """Positions (uint64) given the stream's `count` symbols."""
        esc = self.escape
        low, excess = self._rest(int(np.count_nonzero(sym == esc)) if esc >= 0 else 0)
        out = np.empty(self.count, np.int64)
        _join_status(kernels.gaps.gaps_join(sym, esc, self.shift, low, excess, numel - 1, out, True), numel)
        return out.view(_U64)

    def low_bits(self) -> np.ndarray | None:
        """The gaps' packed low bits, without reading past them; None where the section is
        too short to hold them (`positions` then says so)."""
        n = self._low_bytes
        return self.rd.buf[self.rd.pos:self.rd.pos + n] if n <= self.rd.left else None

    def joined(self, out: np.ndarray, escapes: int, numel: int) -> np.ndarray:
        """Positions (uint64) from the int64 `out` of `kernels.joint.rans_decode_joint_gaps`, which
        joined the gaps as the stream decoded and counted `escapes`: the rest of the
        section read, the escapes' excess added, every position checked (in place)."""
        low, excess = self._rest(escapes)
        _join_status(kernels.gaps.gaps_escapes(out, self.escape, self.shift, low, excess, numel - 1), numel)
        return out.view(_U64)

    @property
    def _low_bytes(self) -> int:
        """The packed low bits' length: count * shift bits, padded to a byte."""
        return (self.count * self.shift + 7) // 8

    def _rest(self, escapes: int) -> tuple[np.ndarray, np.ndarray]:
        """(the low bits, the escapes' excesses as int64): the section's rest, read to its end."""
        rd = self.rd
        low = rd.take(self._low_bytes, "gaps low bits")
        excess = rd.varints(escapes, "gaps escaped quotients")
        rd.done("gaps section")
        if escapes and (excess > _U64(MAX_NUMEL)).any():
            raise PositionsError("gaps escaped quotient beyond 2**63")
        return low, excess.astype(np.int64)


def _join_status(status: int, numel: int) -> None:
    """Raise the PositionsError of a `gaps_join` status (0: nothing)."""
    if status:
        why = {-1: "truncated low bits", -2: "packed bits: non-zero padding",
               -3: "escape count mismatch", -4: "gap beyond 2**63"}.get(status, f"position >= numel {numel}")
        raise PositionsError(why)
