"""Values on the wire (docs/wire-format.md, "Values"): `planes`, and the symbol tables of
`symbols_rans` / `symbols_joint` / `symbols_prefix` (a table of distinct values, escapes,
one symbol per value); value histograms, and the op choice (xor or add, whichever codes
smaller) they serve.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from .. import dtypes, kernels
from ..records import Op
from . import prefix
from .errors import PositionsError
from .rans import RansStream, encode_rans_chunks, read_model
from .varints import Reader, leb128_ints


# Literal values a `symbols_rans` table may hold (one more symbol escapes to raw values).
VALUE_ALPHABET = 1024


def encode_planes(vals: np.ndarray, width: int) -> bytes:
    """Raw `planes` section: the lowest byte of every value, then the next byte of every
    value, and so on (bytes of equal significance together: what makes zstd effective)."""
    return np.ascontiguousarray(vals.view(np.uint8).reshape(vals.size, width).T).tobytes()


def decode_planes(raw: bytes | memoryview, m: int, dt: dtypes.DType) -> np.ndarray:
    """m values (dt's unsigned bit view) from a raw `planes` section of m * itemsize bytes."""
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(dt.itemsize, m)
    # np.array copies: the caller gets writable arrays that own their memory.
    return np.array(planes.T, order="C").view(dt.bits_numpy).reshape(m)


def entropy_bits(counts: np.ndarray) -> float:
    """Empirical (order-0) entropy in bits of a sample with these symbol counts: sum c*log2(m/c)."""
    c = np.asarray(counts, dtype=np.int64)
    return float(kernels.values.entropy_of_counts(c, c.size))


def value_histogram(vals: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values ascending, their counts) of unsigned values of `width` bytes."""
    if width <= 2 and 0 < vals.size <= 1 << 32:
        v = np.ascontiguousarray(vals).view(dtypes.unsigned(width))
        distinct = np.empty(min(v.size, 1 << (8 * width)), v.dtype)
        found = np.empty(distinct.size, np.int64)
        with _histogram_tables(width) as (table, lines):
            k = kernels.values.histogram_lines(v, table, lines, distinct, found)
        return distinct[:k], found[:k]
    return np.unique(vals, return_counts=True)


_TABLES = threading.local()  # per thread: width -> the all-zero tables of kernels.values.histogram_lines


def _zeroed_tables(width: int) -> tuple[np.ndarray, np.ndarray]:
    """(four uint32 counters per value, a flag per four values) for `width`-byte values."""
    tables = _TABLES.__dict__.setdefault("by_width", {})
    if width not in tables:
        nbins = 1 << (8 * width)
        tables[width] = (np.zeros(4 * nbins, np.uint32), np.zeros(nbins // 4, np.uint8))
    return tables[width]


@contextlib.contextmanager
def _histogram_tables(width: int):
    """The thread's zeroed tables for a kernel that counts into them and zeroes them again
    (`kernels.values.histogram_lines`); zeroed here when the kernel is interrupted half-way (as
    Python, without numba): dirty tables would miscount every later histogram."""
    table, lines = _zeroed_tables(width)
    try:
        yield table, lines
    except BaseException:
        table[:] = 0
        lines[:] = 0
        raise


def values_entropy_bits(vals: np.ndarray, width: int) -> float:
    """Empirical order-0 entropy of the values, in bits (sum over values of -log2 frequency)."""
    return entropy_bits(value_histogram(vals, width)[1]) if vals.size else 0.0


def encode_value_symbols(vals: np.ndarray, width: int) -> bytes | None:
    """Raw `symbols_rans` values section, or None when most values would escape.

        varint L                 literal table size, 0..VALUE_ALPHABET
        varint E                 1 if the last symbol (index L) is an escape, else 0
        L x width bytes          the table: distinct values, strictly increasing (<u{width})
        rANS stream              one symbol per value, alphabet L + E (rans.encode_rans)
        width bytes per escape   the escaped values, in order (<u{width})
    """
    parts = value_parts(vals, width)
    if parts is None:
        return None
    sym = parts.sym
    if parts.lut is not None:
        sym = np.empty(parts.sym.size, np.int16)
        kernels.values.map_symbols(parts.sym, parts.lut, sym)
    return b"".join(parts.chunks(encode_rans_chunks(sym, parts.counts)))


class ValueParts:
    """A `symbols_rans` section before its rANS stream is coded (see `value_parts`): the
    symbols are lut[sym] (lut None: sym itself), with these counts."""

    __slots__ = ("head", "sym", "lut", "counts", "tail")

    def __init__(self, head, sym, lut, counts, tail):
        self.head, self.sym, self.lut, self.counts, self.tail = head, sym, lut, counts, tail

    def chunks(self, rans: list) -> list:
        """The raw section as chunks, given the rANS stream of the symbols (as chunks)."""
        return [self.head, *rans, self.tail]


def value_parts(vals: np.ndarray, width: int) -> ValueParts | None:
    """`encode_value_symbols` without the rANS stream (None when most values would escape)."""
    if vals.size == 0:
        return None
    bits = dtypes.unsigned(width)
    distinct, counts = value_histogram(vals, width)
    chosen = value_table(distinct, counts, vals.size)
    if chosen is None:
        return None
    table, escape = chosen
    literal = table.size
    head = leb128_ints(literal, escape) + table.astype(bits, copy=False).tobytes()
    if width <= 2:
        # Without escapes every value is in the table and the lut is read only at the values:
        # the other entries need no fill (a 128 KB memset a record saved).
        lut = np.full(1 << (8 * width), literal, np.int16) if escape else np.empty(1 << (8 * width), np.int16)
        lut[table] = np.arange(literal, dtype=np.int16)
        if not escape:  # the symbols are looked up while they are coded
            return ValueParts(head, np.ascontiguousarray(vals).view(bits), lut, counts, b"")
        sym = np.empty(vals.size, np.int16)
        kernels.values.map_symbols(vals, lut, sym)
    else:
        idx = np.minimum(np.searchsorted(table, vals), max(literal - 1, 0)).astype(np.int32)
        sym = np.where(table[idx] == vals, idx, np.int32(literal)) if literal else np.zeros(vals.size, np.int32)
    alphabet = literal + escape
    if escape:
        sym_counts = np.bincount(sym, minlength=alphabet)
        tail = np.ascontiguousarray(vals[sym == literal]).astype(bits, copy=False).tobytes()
    else:
        sym_counts, tail = counts, b""
    return ValueParts(head, sym, None, sym_counts, tail)


def value_table(distinct: np.ndarray, counts: np.ndarray, m: int) -> tuple[np.ndarray, int] | None:
    """(table, escape flag) of a values section, given the m values' distinct values
    (ascending) and counts: every distinct value when there are at most VALUE_ALPHABET,
    otherwise the most frequent values that repeat, and an escape for the rest; None when
    most values would escape."""
    if distinct.size <= VALUE_ALPHABET:
        return distinct, 0
    keep = np.argpartition(-counts, VALUE_ALPHABET - 1)[:VALUE_ALPHABET]
    keep = keep[counts[keep] > 1]
    if counts[keep].sum() * 2 < m:
        return None
    return np.sort(distinct[keep]), 1


def decode_value_symbols(raw: bytes | memoryview, m: int, dt: dtypes.DType, where: str) -> np.ndarray:
    """m values (dt's unsigned bit view) from a raw `symbols_rans` section; validates everything."""
    v = ValuesReader(raw, m, dt, where)
    return v.values(v.stream.decode(m))


class ValuesReader:
    """A `symbols_rans` section read up to its rANS stream's symbols (`RansStream`), so
    that they can be decoded together with the positions' (`decode_rans_pair`);
    `values` then checks and looks up the rest."""

    __slots__ = ("rd", "m", "dt", "where", "literal", "escape", "table", "stream", "alphabet", "model")

    def __init__(self, raw: bytes | memoryview, m: int, dt: dtypes.DType, where: str, coding: str = "rans"):
        """coding "joint": a `symbols_joint` section (v5): the symbols' model only, no words
        (they are the positions section's joint stream): `model` is read, `stream` is None;
        "prefix": a `symbols_prefix` section (v6): `model` is the symbols' code lengths."""
        self.rd = rd = Reader(raw)
        self.m, self.dt, self.where = m, dt, where
        self.literal = literal = rd.varint(f"{where}: symbols table size", VALUE_ALPHABET)
        self.escape = escape = rd.varint(f"{where}: symbols escape flag", 1)
        if literal + escape == 0:
            raise PositionsError(f"{where}: symbols alphabet is empty")
        self.table = table = rd.take(literal * dt.itemsize, f"{where}: symbols table").view(dt.bits_numpy)
        if literal > 1 and (table[1:] <= table[:-1]).any():
            raise PositionsError(f"{where}: symbols table not strictly increasing")
        if coding == "joint":
            self.stream, self.model = None, read_model(rd, literal + escape, f"{where}: symbols")
            self.alphabet = self.model.size
        elif coding == "prefix":
            alphabet = rd.varint(f"{where}: symbols alphabet", literal + escape)
            if alphabet == 0:
                raise PositionsError(f"{where}: symbols alphabet is empty")
            self.stream, self.model = None, prefix.read_lengths(rd, alphabet, f"{where}: symbols")
            self.alphabet = alphabet
        else:
            self.stream = RansStream.read(rd, literal + escape, f"{where}: symbols", np.int16)
            self.alphabet, self.model = self.stream.alphabet, None

    def _check_alphabet(self) -> None:
        if self.alphabet != self.literal + self.escape:
            raise PositionsError(f"{self.where}: symbol stream alphabet {self.alphabet} != table {self.literal} "
                                 f"+ escape {self.escape}")

    def direct_table(self) -> np.ndarray | None:
        """For a section without escapes whose values are 8 or 16 bits: the checked section's
        table (value symbol -> value), so that the joint decoder writes the values themselves
        (`joint.decode_joint`); None otherwise (then `values` looks the symbols up)."""
        if self.escape or self.dt.itemsize > 2:
            return None
        self._check_alphabet()
        self.rd.done(f"{self.where}: symbols section")
        return self.table

    def values(self, sym: np.ndarray) -> np.ndarray:
        """The m values given the stream's symbols."""
        rd, literal, escape, where, bits = self.rd, self.literal, self.escape, self.where, self.dt.bits_numpy
        self._check_alphabet()
        ext = np.zeros(literal + escape, dtype=bits)
        ext[:literal] = self.table
        vals = np.empty(self.m, dtype=bits)
        kernels.values.lookup(sym, ext, vals)
        if escape:
            hit = np.flatnonzero(sym == literal)
            vals[hit] = rd.take(hit.size * self.dt.itemsize, f"{where}: escaped values").view(bits)
        rd.done(f"{where}: symbols section")
        return vals


def choose_op(xor_values: np.ndarray, add_values: np.ndarray, width: int) -> Op:
    """XOR or ADD, whichever codes smaller (estimated from the values' empirical entropy)."""
    if xor_values.size == 0:
        return Op.XOR
    hx = value_histogram(xor_values, width)[1]
    ha = value_histogram(add_values, width)[1]
    return Op.ADD if entropy_bits(ha) < entropy_bits(hx) else Op.XOR


def choose_op_from_add(add_values: np.ndarray, new_bits: np.ndarray, width: int) -> Op:
    """`choose_op` for changes given as their add values and new bits (xor = new ^ old,
    old = new - add), as the producer's op "auto" keeps them: one compiled call for
    16-bit and narrower values."""
    if add_values.size == 0:
        return Op.XOR
    if width > 2:
        return choose_op(new_bits ^ (new_bits - add_values), add_values, width)
    a = np.ascontiguousarray(add_values).view(dtypes.unsigned(width))
    n = np.ascontiguousarray(new_bits).view(dtypes.unsigned(width))
    room = min(a.size, 1 << (8 * width))
    with _histogram_tables(width) as (table, lines):
        hx, ha = kernels.values.xor_add_entropies(a, n, table, lines, np.empty(room, a.dtype), np.empty(room, np.int64))
    return Op.ADD if ha < hx else Op.XOR
