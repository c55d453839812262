"""Position and symbol encodings for the wire codec (format v2, docs/wire-format.md).

Two position encodings live here: `runs` (below, v1's encoding, kept for records made
of long runs and for tiny records) and `gaps` (entropy-coded gaps, see
`encode_gaps`). `encode_symbols` / `decode_symbols` are the shared static-model ANS
stream that `gaps` and the codec's `symbols` value encoding are built on.

`runs`: sorted flat indices <-> run/gap varints.

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

import math

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
    if (_k.HAVE_NUMBA and positions.dtype == _U64 and positions.flags.c_contiguous
            and _k.strictly_increasing_below(positions.view(np.int64), numel - 1) == 0):
        return None  # one compiled pass; on a failure the numpy checks below name it
    if np.any(positions[1:] <= positions[:-1]):
        return "positions not strictly increasing"
    if int(positions[-1]) >= numel:
        return f"position {int(positions[-1])} >= numel {numel}"
    return None


# ================================================================ entropy-coded streams
#
# A *symbol stream* codes m symbols from the alphabet {0 .. A-1} with a static model
# that travels with it: the exact count of every symbol, then the symbols themselves,
# range-coded by an asymmetric numeral system (constriction's stack-based `AnsCoder`,
# 32-bit words, over `Categorical(counts / m, perfect=False)`). It costs the empirical
# entropy of the symbols plus the count table plus at most ~8 bytes. Layout:
#
#     varint A                      alphabet size, 1 <= A <= max_alphabet
#     A varints                     count of each symbol; they sum to m
#     varint W                      number of 32-bit ANS words (0 if one symbol only)
#     W x u32 little-endian         the ANS words
#
# The decoder checks every count and length before it allocates anything, decodes
# exactly m symbols and requires the ANS coder to end exactly empty, so a stream that
# was cut, padded or altered is rejected rather than silently misread.

try:  # the ANS coder; a hard dependency of the package (pyproject.toml)
    import constriction as _constriction
except ImportError:  # pragma: no cover - reported when a stream is actually coded
    _constriction = None

_SYMBOL_CAP_POSITIONS = 256  # quotient alphabet of `gaps` (the last symbol escapes)


def _ans():
    if _constriction is None:  # pragma: no cover
        raise RuntimeError("the `constriction` package is required for entropy-coded streams "
                           "(pip install 'constriction>=0.5,<0.6')")
    return _constriction


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
        window = self.buf[self.pos:self.pos + min(self.left, _MAX_VARINT_BYTES * n)]
        ends = np.flatnonzero((window & 0x80) == 0)
        if ends.size < n:
            raise PositionsError(f"{what}: truncated varints")
        stop = int(ends[n - 1]) + 1
        vals = leb128_decode(window[:stop])
        self.pos += stop
        return vals

    def varint(self, what: str, hi: int) -> int:
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


def entropy_bits(counts: np.ndarray) -> float:
    """Empirical (order-0) entropy in bits of a sample with these symbol counts: sum c*log2(m/c)."""
    c = np.asarray(counts, dtype=np.float64)
    c = c[c > 0]
    m = c.sum()
    return float((c * (np.log2(m) - np.log2(c))).sum()) if m else 0.0


def encode_symbols(symbols: np.ndarray, alphabet: int, counts: np.ndarray | None = None) -> bytes:
    """Symbol stream (see above) of `symbols` (ints in [0, alphabet))."""
    sym = np.ascontiguousarray(symbols)
    if counts is None:
        counts = np.bincount(sym, minlength=alphabet) if sym.size else np.zeros(alphabet, np.int64)
    head = leb128_encode(np.concatenate(([alphabet], counts)).astype(_U64)).tobytes()
    if np.count_nonzero(counts) <= 1:
        return head + b"\x00"
    ans = _ans()
    model = ans.stream.model.Categorical(counts.astype(np.float64) / float(sym.size), perfect=False)
    coder = ans.stream.stack.AnsCoder()
    coder.encode_reverse(sym.astype(np.int32, copy=False), model)
    words = coder.get_compressed().astype("<u4", copy=False)
    return head + leb128_encode(np.array([words.size], _U64)).tobytes() + words.tobytes()


def decode_symbols(r: Reader, m: int, max_alphabet: int, what: str) -> tuple[np.ndarray, int]:
    """(m symbols as int32, alphabet size) from a symbol stream at the reader's cursor."""
    alphabet = r.varint(f"{what} alphabet size", max_alphabet)
    if alphabet < 1:
        raise PositionsError(f"{what}: empty alphabet")
    counts = r.varints(alphabet, f"{what} symbol counts")
    if np.any(counts > _U64(m)) or int(counts.sum(dtype=_U64)) != m:
        raise PositionsError(f"{what}: symbol counts do not sum to {m}")
    nwords = r.varint(f"{what} ANS word count", r.left // 4)
    nonzero = np.flatnonzero(counts)
    if nonzero.size <= 1:
        if nwords:
            raise PositionsError(f"{what}: a one-symbol stream carries no ANS words")
        return np.full(m, nonzero[0] if nonzero.size else 0, dtype=np.int32), alphabet
    words = r.take(4 * nwords, f"{what} ANS words").view("<u4").astype(np.uint32)
    if nwords == 0 or words[-1] == 0:
        raise PositionsError(f"{what}: malformed ANS stream")
    ans = _ans()
    model = ans.stream.model.Categorical(counts.astype(np.float64) / float(m), perfect=False)
    try:
        coder = ans.stream.stack.AnsCoder(words)
        sym = coder.decode(model, m)
        empty = coder.is_empty()
    except BaseException as e:  # the Rust coder reports bad data as ValueError or a panic
        if isinstance(e, (KeyboardInterrupt, SystemExit, MemoryError)):
            raise
        raise PositionsError(f"{what}: corrupt ANS stream ({type(e).__name__})") from None
    if not empty:
        raise PositionsError(f"{what}: ANS stream does not end where its {m} symbols do")
    if np.any(counts[nonzero] != np.bincount(sym, minlength=alphabet)[nonzero].astype(_U64)):
        raise PositionsError(f"{what}: decoded symbols do not match the declared counts")
    return sym, alphabet


def symbols_size_estimate(counts: np.ndarray) -> float:
    """Bytes a symbol stream with these counts takes (entropy + table), for choosing."""
    table = float(np.count_nonzero(counts)) * 1.5 + 2 + len(counts) * 0.2
    return entropy_bits(counts) / 8.0 + table + (4 if np.count_nonzero(counts) > 1 else 0)


# ---------------------------------------------------------------- gaps


def _choose_shift(g: np.ndarray) -> int:
    """Rice shift r: quotients g >> r are entropy-coded, the r low bits sent raw.

    Picks the best of three shifts around log2(mean gap) by estimated size, on a
    sample of at most 2**16 gaps (the choice only affects size, never correctness)."""
    s = g[:: max(1, g.size >> 16)]
    mean = float(s.mean()) if s.size else 0.0
    if mean < 2.0:
        return 0
    base = max(0, int(math.floor(math.log2(mean))) - 2)
    best, best_r = None, base
    for r in (base, base + 1, base + 2):
        counts = np.bincount(np.minimum(s >> r, _SYMBOL_CAP_POSITIONS - 1))
        esc = counts[_SYMBOL_CAP_POSITIONS - 1] if counts.size == _SYMBOL_CAP_POSITIONS else 0
        size = entropy_bits(counts) + s.size * r + 24 * esc
        if best is None or size < best:
            best, best_r = size, r
    return best_r


def pack_bits(values: np.ndarray, r: int) -> bytes:
    """The r low bits of each value (r <= 63), concatenated MSB first, zero-padded to a byte."""
    n = values.size
    if r == 0 or n == 0:
        return b""
    if r <= 8:  # 8 values of r bits make r bytes: build them in one uint64 per group
        v = np.zeros(-(-n // 8) * 8, dtype=np.uint64)
        v[:n] = values
        v = v.reshape(-1, 8)
        word = np.zeros(v.shape[0], dtype=np.uint64)
        for j in range(8):
            word |= v[:, j] << np.uint64(r * (7 - j))
        out = word.astype(">u8").view(np.uint8).reshape(-1, 8)[:, 8 - r:].reshape(-1)
        return out[:(n * r + 7) // 8].tobytes()
    bits = (values.astype(np.uint64)[:, None] >> np.arange(r - 1, -1, -1, dtype=np.uint64)) & np.uint64(1)
    return np.packbits(bits.astype(np.uint8).reshape(-1)).tobytes()


def unpack_bits(packed: np.ndarray, n: int, r: int) -> np.ndarray:
    """Inverse of pack_bits (uint64); rejects non-zero padding."""
    if r == 0 or n == 0:
        return np.zeros(n, dtype=_U64)
    if r <= 8:
        groups = -(-n // 8)
        b = np.zeros(groups * r, dtype=np.uint8)
        b[:packed.size] = packed
        w = np.zeros((groups, 8), dtype=np.uint8)
        w[:, 8 - r:] = b.reshape(groups, r)
        word = w.reshape(-1).view(">u8").astype(np.uint64)
        mask = np.uint64((1 << r) - 1)
        out = np.empty((groups, 8), dtype=np.uint64)
        for j in range(8):
            out[:, j] = (word >> np.uint64(r * (7 - j))) & mask
        if np.any(out.reshape(-1)[n:]):
            raise PositionsError("packed bits: non-zero padding")
        return out.reshape(-1)[:n]
    bits = np.unpackbits(packed)
    if np.any(bits[n * r:]):
        raise PositionsError("packed bits: non-zero padding")
    bits = bits[:n * r].reshape(n, r).astype(_U64)
    low = np.zeros(n, dtype=_U64)
    for j in range(r):  # at most 63 passes over one column of bits
        low |= bits[:, j] << _U64(r - 1 - j)
    return low


def encode_gaps(positions: np.ndarray) -> bytes:
    """Raw `gaps` section for sorted, validated uint64 positions (count >= 1).

        varint r                     Rice shift, 0..63
        symbol stream                quotients min(g >> r, 255) of the gaps, A <= 256
        ceil(count*r/8) bytes        the r low bits of every gap, MSB first, zero-padded
        varints                      for each quotient symbol 255 (when A == 256): (g >> r) - 255

    where g_0 = p_0 and g_i = p_i - p_(i-1) - 1 (so g >= 0).
    """
    p = np.ascontiguousarray(positions, dtype=_U64).view(np.int64)  # positions < 2**63
    g = np.empty_like(p)
    g[0] = p[0]
    np.subtract(p[1:], p[:-1], out=g[1:])
    g[1:] -= 1
    r = _choose_shift(g)
    q = g >> r if r else g
    top = int(q.max())
    esc = _SYMBOL_CAP_POSITIONS - 1
    sym = q.astype(np.int32) if top < esc else np.minimum(q, esc).astype(np.int32)
    alphabet = min(top, esc) + 1
    out = [leb128_encode(np.array([r], _U64)).tobytes(), encode_symbols(sym, alphabet)]
    if r:
        out.append(pack_bits((g & ((1 << r) - 1)).astype(np.uint64), r))
    if alphabet == _SYMBOL_CAP_POSITIONS:
        out.append(leb128_encode((q[sym == esc] - esc).astype(_U64)).tobytes())
    return b"".join(out)


def decode_gaps(raw: bytes | memoryview, count: int, numel: int) -> np.ndarray:
    """Positions (uint64) from a raw `gaps` section; validated against count and numel."""
    if count == 0:
        raise PositionsError("a 'gaps' section needs at least one position")
    rd = Reader(raw)
    r = rd.varint("gaps shift", 63)
    sym, alphabet = decode_symbols(rd, count, _SYMBOL_CAP_POSITIONS, "gaps quotients")
    g = sym.astype(_U64)
    if r:
        low = unpack_bits(rd.take((count * r + 7) // 8, "gaps low bits"), count, r)
    if alphabet == _SYMBOL_CAP_POSITIONS:
        where = np.flatnonzero(sym == _SYMBOL_CAP_POSITIONS - 1)
        extra = rd.varints(where.size, "gaps escaped quotients")
        if np.any(extra > _U64(MAX_NUMEL)):
            raise PositionsError("gaps escaped quotient beyond 2**63")
        g[where] += extra
    rd.done("gaps section")
    if np.any(g > _U64(MAX_NUMEL >> r)):
        raise PositionsError("gap beyond 2**63")
    if r:
        g = (g << _U64(r)) | low
    if np.any(g >= _U64(numel)):
        raise PositionsError(f"position >= numel {numel}")
    with np.errstate(over="ignore"):
        pos = np.cumsum(g + _U64(1), dtype=_U64)
    if pos.size > 1 and np.any(pos[1:] <= pos[:-1]):
        raise PositionsError("positions overflow 64 bits")
    if int(pos[-1]) > numel:
        raise PositionsError(f"position {int(pos[-1]) - 1} >= numel {numel}")
    pos -= _U64(1)
    return pos


# ================================================================ format v3: rANS streams
#
# A *rANS stream* codes m symbols from {0 .. A-1} like a symbol stream, but with the
# package's own coder (nemo_dcr.kernels, compiled with numba): a static model quantised
# to 2**16, two interleaved 32-bit rANS states, 16-bit words. Layout:
#
#     varint A                      alphabet size, 1 <= A <= max_alphabet
#     A varints                     quantised frequency of each symbol, 0..2**16; sum 2**16
#     varint W                      number of 16-bit words: 0 when one frequency is 2**16,
#                                   otherwise >= 4
#     W x u16 little-endian         x0 (low, high), x1 (low, high), renormalisation words
#
# Symbol i is coded by state i % 2. The decoder checks the table before it allocates,
# decodes exactly m symbols, and requires both states to end at 2**16 with every word
# read. Quantisation (`quantize`) is integer-only, so it is part of the format and the
# same everywhere.

from . import kernels as _k  # noqa: E402

RANS_SCALE = _k.PROB_SCALE


def quantize(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to 2**16 for symbol counts (>= 2 non-zero): floor(c * 2**16 / m),
    raised to 1 where c > 0; the remainder goes to the first most frequent symbol, and
    an excess is taken from the currently largest frequencies (first first), keeping >= 1."""
    c = [int(x) for x in np.asarray(counts).tolist()]
    m = sum(c)
    freq = [(x * RANS_SCALE) // m for x in c]
    for i, x in enumerate(c):
        if x and not freq[i]:
            freq[i] = 1
    diff = RANS_SCALE - sum(freq)
    big = max(range(len(c)), key=lambda i: (c[i], -i))
    if freq[big] + diff >= 1:
        freq[big] += diff
    else:
        while diff < 0:
            i = max(range(len(freq)), key=lambda j: (freq[j], -j))
            take = min(freq[i] - 1, -diff)
            freq[i] -= take
            diff += take
    return np.array(freq, dtype=np.int64)


def encode_rans(symbols: np.ndarray, counts: np.ndarray) -> bytes:
    """rANS stream (see above) of `symbols` (ints in [0, len(counts))) with these counts."""
    counts = np.asarray(counts, dtype=np.int64)
    alphabet = counts.size
    nz = np.flatnonzero(counts)
    if nz.size <= 1:
        freq = np.zeros(alphabet, np.int64)
        if nz.size:
            freq[nz[0]] = RANS_SCALE
        return leb128_encode(np.concatenate(([alphabet], freq, [0])).astype(_U64)).tobytes()
    freq = quantize(counts)
    cum = np.zeros(alphabet, np.int64)
    np.cumsum(freq[:-1], out=cum[1:])
    out = np.empty(symbols.size + 4, dtype="<u2")
    start = _k.rans_encode(symbols, freq, cum, out)
    words = out[start:]
    head = leb128_encode(np.concatenate(([alphabet], freq, [words.size])).astype(_U64)).tobytes()
    return head + words.tobytes()


def decode_rans(r: Reader, m: int, max_alphabet: int, what: str, out_dtype=np.int32) -> tuple[np.ndarray, int]:
    """(m symbols, alphabet size) from a rANS stream at the reader's cursor."""
    alphabet = r.varint(f"{what} alphabet size", max_alphabet)
    if alphabet < 1:
        raise PositionsError(f"{what}: empty alphabet")
    freq = r.varints(alphabet, f"{what} frequencies")
    if np.any(freq > _U64(RANS_SCALE)) or int(freq.sum(dtype=_U64)) != RANS_SCALE:
        raise PositionsError(f"{what}: frequencies do not sum to {RANS_SCALE}")
    nwords = r.varint(f"{what} word count", r.left // 2)
    nonzero = np.flatnonzero(freq)
    if nonzero.size == 1:
        if nwords:
            raise PositionsError(f"{what}: a one-symbol stream carries no words")
        return np.full(m, nonzero[0], dtype=out_dtype), alphabet
    if nwords < 4:
        raise PositionsError(f"{what}: malformed rANS stream ({nwords} words)")
    words = r.take(2 * nwords, f"{what} words").view("<u2")
    freq = freq.astype(np.int64)
    cum = np.zeros(alphabet, np.int64)
    np.cumsum(freq[:-1], out=cum[1:])
    slot2sym = np.repeat(np.arange(alphabet, dtype=out_dtype), freq)
    sym = np.empty(m, dtype=out_dtype)
    status = _k.rans_decode(words, freq, cum, slot2sym, sym)
    if status:
        why = {-1: "bad initial state", -2: "words run out",
               -3: "stream does not end where its symbols do"}.get(status, "corrupt")
        raise PositionsError(f"{what}: corrupt rANS stream ({why})")
    return sym, alphabet


def _sample_gaps(p: np.ndarray) -> np.ndarray:
    """At most ~2**14 gaps of sorted int64 positions, evenly spread (shift choice only)."""
    step = max(1, p.size >> 14)
    if step == 1:
        g = np.empty_like(p)
        g[0] = p[0]
        np.subtract(p[1:], p[:-1], out=g[1:])
        g[1:] -= 1
        return g
    idx = np.arange(0, p.size - 1, step)
    return p[idx + 1] - p[idx] - 1


def encode_gaps_rans(positions: np.ndarray) -> tuple[bytes, int]:
    """Raw `gaps_rans` section for sorted, validated positions (count >= 1), and the
    number of later gaps equal to 0 (positions adjacent to the previous one).

        varint r                     Rice shift, 0..63
        rANS stream                  quotients min(g >> r, 255) of the gaps, A <= 256
        ceil(count*r/8) bytes        the r low bits of every gap, MSB first, zero-padded
        varints                      for each quotient symbol 255: (g >> r) - 255

    with g_0 = p_0, g_i = p_i - p_(i-1) - 1 (the layout of `gaps`, another stream)."""
    p = np.ascontiguousarray(positions).view(np.int64)  # positions < 2**63
    n = p.size
    r = _choose_shift(_sample_gaps(p))
    esc = _SYMBOL_CAP_POSITIONS - 1
    sym = np.empty(n, np.uint8)
    counts = np.zeros(_SYMBOL_CAP_POSITIONS, np.int64)
    low = np.empty((n * r + 7) // 8, np.uint8)
    excess = np.empty(n, np.int64)
    nb, ne, zeros = _k.gaps_split(p, r, esc, sym, counts, low, excess)
    alphabet = int(np.flatnonzero(counts)[-1]) + 1
    out = [leb128_encode(np.array([r], _U64)).tobytes(), encode_rans(sym, counts[:alphabet]),
           low[:nb].tobytes()]
    if ne:
        out.append(leb128_encode(excess[:ne].astype(_U64)).tobytes())
    return b"".join(out), int(zeros)


def decode_gaps_rans(raw: bytes | memoryview, count: int, numel: int) -> np.ndarray:
    """Positions (uint64) from a raw `gaps_rans` section; validated against count and numel."""
    if count == 0:
        raise PositionsError("a 'gaps_rans' section needs at least one position")
    rd = Reader(raw)
    r = rd.varint("gaps shift", 63)
    esc = _SYMBOL_CAP_POSITIONS - 1
    sym, alphabet = decode_rans(rd, count, _SYMBOL_CAP_POSITIONS, "gaps quotients", np.uint8)
    low = rd.take((count * r + 7) // 8, "gaps low bits")
    nesc = int(np.count_nonzero(sym == esc)) if alphabet == _SYMBOL_CAP_POSITIONS else 0
    excess = rd.varints(nesc, "gaps escaped quotients")
    rd.done("gaps section")
    if np.any(excess > _U64(MAX_NUMEL)):
        raise PositionsError("gaps escaped quotient beyond 2**63")
    out = np.empty(count, np.int64)
    status = _k.gaps_join(sym, esc if alphabet == _SYMBOL_CAP_POSITIONS else -1, r, low,
                          excess.astype(np.int64), numel - 1, out)
    if status:
        why = {-1: "truncated low bits", -2: "packed bits: non-zero padding",
               -3: "escape count mismatch", -4: "gap beyond 2**63"}.get(status, f"position >= numel {numel}")
        raise PositionsError(why)
    return out.view(_U64)
