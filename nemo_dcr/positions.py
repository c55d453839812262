"""Position encodings and entropy-coded streams for the wire codec (formats v5 and v6;
docs/wire-format.md).

Two position encodings live here: `runs` (below, v1's encoding, kept for records made
of long runs and for tiny records) and `gaps_rans` (Rice-split gaps whose quotients are
rANS-coded, see `encode_gaps_rans`). `encode_rans` / `decode_rans` are the rANS stream
that `gaps_rans` and the codec's `symbols_rans` value encoding are built on.

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

import threading

import numpy as np

from . import kernels

# Largest number of elements a canonical tensor may have on the wire. Positions are
# therefore < 2**63 and fit a signed int64 as well (torch indexing is int64).
MAX_NUMEL = 1 << 63

_U64 = np.uint64
_U32 = np.uint32
_MAX_VARINT_BYTES = 10  # ceil(64 / 7)


class PositionsError(ValueError):
    """Malformed or out-of-range position data."""


# ---------------------------------------------------------------- LEB128 varints


def leb128_ints(*values: int) -> bytes:
    """Unsigned LEB128 of a few Python ints, concatenated: `leb128_encode` without an array
    (a section's shift or table sizes: ~0.2 us where building the array took ~2)."""
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
        out = np.empty(_MAX_VARINT_BYTES * x.size, dtype=np.uint8)
        return out[:kernels.varints.leb128(x, out)]
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

    `positions` must already be validated: uint64 (or uint32), strictly increasing.
    """
    if positions.size == 0:
        return b""
    if kernels.common.HAVE_NUMBA and positions.dtype in (_U64, _U32):  # one compiled pass, the same bytes
        out = np.empty(2 * _MAX_VARINT_BYTES * positions.size, np.uint8)
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


# ================================================================ entropy-coded streams
#
# `Reader` parses the raw sections of the entropy-coded encodings; `entropy_bits` is the
# empirical entropy the encoder (`codec.choose_op`) and the benchmarks measure against.


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
        window = self.buf[self.pos:self.pos + min(self.left, _MAX_VARINT_BYTES * n)]
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


def entropy_bits(counts: np.ndarray) -> float:
    """Empirical (order-0) entropy in bits of a sample with these symbol counts: sum c*log2(m/c)."""
    c = np.asarray(counts, dtype=np.int64)
    return float(kernels.values.entropy_of_counts(c, c.size))


# ================================================================ rANS streams
#
# A *rANS stream* codes m symbols from {0 .. A-1} with the package's own coder
# (nemo_dcr.kernels, compiled with numba): a static model quantised to 2**16 and sent
# alongside, two interleaved 32-bit rANS states, 16-bit words. Layout:
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

RANS_SCALE = kernels.rans.PROB_SCALE


def quantize(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to 2**16 for symbol counts (>= 2 non-zero): floor(c * 2**16 / m),
    raised to 1 where c > 0; the remainder goes to the first most frequent symbol, and
    an excess is taken from the currently largest frequencies (first first), keeping >= 1."""
    counts = np.asarray(counts)
    if counts.dtype.kind in "iu" and counts.size:
        # The same integers, compiled (kernels.rans.rans_model) wherever its fast path applies.
        freq = np.empty(counts.size, np.int64)
        if kernels.rans.rans_model(counts.astype(np.int64, copy=False), freq, np.empty(counts.size, np.int64)) > 1:
            return freq
    return _quantize_general(counts)


def _quantize_general(counts: np.ndarray) -> np.ndarray:
    """`quantize` in Python integers, whatever the counts' size."""
    c = [int(x) for x in counts.tolist()]
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


# The encoder hands streams and raw sections on as *chunks*: a list of the buffers they are
# made of, in order (a header's bytes, the coder's word array, ...), joined once, into the
# payload (codec.encode), instead of copied again at every level that puts a header in front.


def chunks_size(chunks: list) -> int:
    """Bytes in a list of chunks."""
    return sum(memoryview(c).nbytes for c in chunks)


def encode_rans(symbols: np.ndarray, counts: np.ndarray) -> bytes:
    """rANS stream (see above) of `symbols` (ints in [0, len(counts))) with these counts."""
    return b"".join(encode_rans_chunks(symbols, counts))


def encode_rans_chunks(symbols: np.ndarray, counts: np.ndarray) -> list:
    """`encode_rans` as chunks."""
    counts = np.asarray(counts, dtype=np.int64)
    table = rans_table(counts)
    if isinstance(table, bytes):
        return [table]
    freq, cum = table
    out = np.empty(symbols.size + 4, dtype="<u2")
    start = kernels.rans.rans_encode(symbols, freq, cum, out)
    return rans_stream_chunks(freq, out[start:])


def encode_rans_pair(sym1: np.ndarray, counts1: np.ndarray, sym2: np.ndarray, counts2: np.ndarray,
                     lut2: np.ndarray | None = None) -> tuple[list, list]:
    """(encode_rans(sym1, counts1), encode_rans(lut2[sym2], counts2)) as chunks - the same
    bytes - coding both streams in one compiled pass when they have the same length (their
    dependency chains then overlap: `kernels.rans.rans_encode2`). lut2=None: sym2 are the
    symbols."""
    counts1 = np.asarray(counts1, dtype=np.int64)
    counts2 = np.asarray(counts2, dtype=np.int64)
    t1, t2 = rans_table(counts1), rans_table(counts2)
    if isinstance(t1, bytes) or isinstance(t2, bytes) or sym1.size != sym2.size or not kernels.common.HAVE_NUMBA:
        s2 = sym2 if lut2 is None else lut2[sym2]
        return ([t1] if isinstance(t1, bytes) else encode_rans_chunks(sym1, counts1),
                [t2] if isinstance(t2, bytes) else encode_rans_chunks(s2, counts2))
    if lut2 is None:
        lut2 = np.arange(counts2.size, dtype=np.int32)
    out1 = np.empty(sym1.size + 4, dtype="<u2")
    out2 = np.empty(sym2.size + 4, dtype="<u2")
    s1, s2 = kernels.rans.rans_encode2(sym1, t1[0], t1[1], out1, sym2, lut2, t2[0], t2[1], out2)
    return rans_stream_chunks(t1[0], out1[s1:]), rans_stream_chunks(t2[0], out2[s2:])


def rans_table(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray] | bytes:
    """(quantised frequencies, their exclusive prefix sums) for int64 counts, or the whole
    stream when at most one symbol occurs (it carries no words)."""
    alphabet = counts.size
    freq = np.empty(alphabet, np.int64)
    cum = np.empty(alphabet, np.int64)
    used = kernels.rans.rans_model(counts, freq, cum)  # one compiled call: the common case
    if used == -1:  # counts the fast path does not take (a sum >= 2**46, ...)
        used = int(np.count_nonzero(counts))
        if used > 1:
            freq = _quantize_general(counts)
            cum[0] = 0
            np.cumsum(freq[:-1], out=cum[1:])
    if used <= 1:
        freq[:] = 0
        if used:
            freq[np.flatnonzero(counts)[0]] = RANS_SCALE
        return leb128_encode(np.concatenate(([alphabet], freq, [0])).astype(_U64)).tobytes()
    return freq, cum


def rans_stream_chunks(freq: np.ndarray, words: np.ndarray) -> list:
    """The stream's chunks: its header, then the words' buffer as it is (not copied)."""
    return [model_bytes(freq, words.size), words]


def read_model(r: Reader, max_alphabet: int, what: str) -> np.ndarray:
    """A stream's model at the reader's cursor (alphabet size, then every quantised
    frequency), checked: uint64 frequencies, 1 <= alphabet <= max_alphabet, summing to 2**16.
    A valid model is read in one compiled call (`kernels.varints.model_parse`); what it refuses is
    read again step by step, which names the fault."""
    if kernels.common.HAVE_NUMBA:
        out = np.empty(max(1, min(max_alphabet, r.left)), _U64)  # each frequency takes a byte or more
        alphabet, end = kernels.varints.model_parse(r.buf, r.pos, max_alphabet, RANS_SCALE, out)
        if alphabet:
            r.pos = int(end)
            return out[:alphabet]
    alphabet = r.varint(f"{what} alphabet size", max_alphabet)
    if alphabet < 1:
        raise PositionsError(f"{what}: empty alphabet")
    freq = r.varints(alphabet, f"{what} frequencies")
    if np.any(freq > _U64(RANS_SCALE)) or int(freq.sum(dtype=_U64)) != RANS_SCALE:
        raise PositionsError(f"{what}: frequencies do not sum to {RANS_SCALE}")
    return freq


def model_bytes(freq: np.ndarray, *trailer: int) -> bytes:
    """A stream's model as `read_model` reads it, then the varints `trailer` (a stream's
    word count). Written into one uint64 array: concatenating the lists took 6 us a header."""
    x = np.empty(1 + freq.size + len(trailer), _U64)
    x[0] = freq.size
    x[1:1 + freq.size] = freq
    x[1 + freq.size:] = trailer
    return leb128_encode(x).tobytes()


class RansStream:
    """A rANS stream whose model and words have been read (`read`), ready to decode."""

    __slots__ = ("what", "dtype", "alphabet", "only", "words", "freq", "cum", "slot2sym")

    @classmethod
    def read(cls, r: Reader, max_alphabet: int, what: str, out_dtype) -> RansStream:
        """Parse and check the stream at the reader's cursor (everything but its symbols)."""
        self = cls()
        self.what, self.dtype = what, np.dtype(out_dtype)
        freq = read_model(r, max_alphabet, what)
        self.alphabet = alphabet = freq.size
        nwords = r.varint(f"{what} word count", r.left // 2)
        self.only = int(freq.argmax()) if np.count_nonzero(freq) == 1 else None  # a stream of one symbol
        if self.only is not None:
            if nwords:
                raise PositionsError(f"{what}: a one-symbol stream carries no words")
            self.words = None
            return self
        if nwords < 4:
            raise PositionsError(f"{what}: malformed rANS stream ({nwords} words)")
        self.words = r.take(2 * nwords, f"{what} words").view("<u2")
        self.freq = freq.astype(np.int64)
        self.cum = np.empty(alphabet, np.int64)
        self.slot2sym = np.empty(RANS_SCALE, out_dtype)  # the model sums to RANS_SCALE (read_model)
        kernels.rans.rans_slot_table(self.freq, self.cum, self.slot2sym)
        return self

    def model(self) -> tuple:
        return self.words, self.freq, self.cum, self.slot2sym

    def decode(self, m: int) -> np.ndarray:
        """The m symbols of the stream."""
        if self.only is not None:
            return np.full(m, self.only, dtype=self.dtype)
        sym = np.empty(m, dtype=self.dtype)
        self.check(kernels.rans.rans_decode(*self.model(), sym))
        return sym

    def check(self, status: int) -> None:
        """Raise for a decoder status (kernels.rans.rans_decode) other than 0."""
        if status:
            why = {-1: "bad initial state", -2: "words run out",
                   -3: "stream does not end where its symbols do"}.get(status, "corrupt")
            raise PositionsError(f"{self.what}: corrupt rANS stream ({why})")


def decode_rans(r: Reader, m: int, max_alphabet: int, what: str, out_dtype=np.int32) -> tuple[np.ndarray, int]:
    """(m symbols, alphabet size) from a rANS stream at the reader's cursor."""
    st = RansStream.read(r, max_alphabet, what, out_dtype)
    return st.decode(m), st.alphabet


def decode_rans_pair(a: RansStream, b: RansStream, m: int) -> tuple[np.ndarray, int, np.ndarray, int]:
    """(symbols, status) of both streams, m symbols each, decoded in one compiled pass
    (`kernels.rans.rans_decode2`: their dependency chains overlap); both must carry words.
    The caller raises `a.check(status_a)`, `b.check(status_b)` where its own order wants."""
    sa = np.empty(m, dtype=a.dtype)
    sb = np.empty(m, dtype=b.dtype)
    st_a, st_b = kernels.rans.rans_decode2(*a.model(), sa, *b.model(), sb)
    return sa, int(st_a), sb, int(st_b)


# ================================================================ gaps_rans

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
        followed by the words of the record's joint stream (`nemo_dcr.joint`): `model`
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
