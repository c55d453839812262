"""rANS streams (docs/wire-format.md, "rANS streams"): what `gaps_rans` and `symbols_rans`
carry their symbols in, and what `gaps_joint` / `symbols_joint` carry their models in.

A *rANS stream* codes m symbols from {0 .. A-1} with the package's own coder
(nemo_dcr.kernels.rans, compiled with numba): a static model quantised to 2**16 and sent
alongside, two interleaved 32-bit rANS states, 16-bit words. Layout:

    varint A                      alphabet size, 1 <= A <= max_alphabet
    A varints                     quantised frequency of each symbol, 0..2**16; sum 2**16
    varint W                      number of 16-bit words: 0 when one frequency is 2**16,
                                  otherwise >= 4
    W x u16 little-endian         x0 (low, high), x1 (low, high), renormalisation words

Symbol i is coded by state i % 2. The decoder checks the table before it allocates,
decodes exactly m symbols, and requires both states to end at 2**16 with every word
read. Quantisation (`quantize`) is integer-only, so it is part of the format and the
same everywhere.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from .errors import PositionsError
from .varints import Reader, leb128_encode

_U64 = np.uint64

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
    """Bytes in a list of chunks (bytes-like, or arrays and tensors: their nbytes)."""
    return sum(c.nbytes if hasattr(c, "nbytes") else len(c) for c in chunks)


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
    word count). Written into one uint64 array: about half the time of concatenating the
    lists."""
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
