"""Baseline-conditioned records (docs/wire-format.md, "Conditioned records"): a record's
changes coded against the old bits that the producer and every receiver hold bit for bit.

Under AdamW a step of about the learning rate crosses a BF16 rounding boundary far more
often for small weights (small ULP) than for large ones, and moves them by more ULPs: the
old value's exponent predicts both whether an element changes and by how much. So:

- the record's universe is a span of its tensor, canonical positions lo .. lo + n, whose
  old bits both ends read; each element's class is its old exponent field;
- positions: per class, the gaps between its changes counted in that class's elements
  only, Golomb-coded with a parameter per class (near the binary entropy of the class's
  change rate: what an order-0 gap coder spends on the mix of rates, less);
- values: symbols (add: zigzag of the signed step, xor: the value) in one rANS stream
  whose table is the one of the change's class group (adjacent classes merged until a
  group has enough changes to pay for its table);
- the payload names the universe and a digest of its old bits (`baseline_digest`); a
  decoder whose own bits differ refuses the record before decoding it.

Only 2-byte floating-point records (BF16, FP16) with xor or add values are coded so; the
codec picks this encoding per record when it is smaller than the unconditioned one.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Protocol
import numpy as np
import xxhash

from .. import dtypes, kernels
from ..kernels.conditioned import ALPHABET, SCALE
from ..records import BaseSpan, Op
from .errors import PositionsError
from .varints import Reader, leb128_ints

# (shift, mask) of the exponent field: the class of an element is (bits >> shift) & mask.
CLASS_FIELDS = {"BF16": (7, 0xFF), "F16": (10, 0x1F)}
MAX_GOLOMB = 1 << 40
# Smallest change count a value group is closed at, tried in turn (the cheapest estimate wins).
_GROUP_MINS = (1 << 62, 16384, 4096, 1024, 256)
_M_FACTORS = (0.8, 1.0, 1.25)
_NO_BITS = np.zeros(0, np.uint8)  # golomb_write's buffer when it only counts  # Golomb parameters tried around the geometric optimum


class BaselineSource(Protocol):
    """Where a decoder reads the committed bits a conditioned record was coded against."""

    def bits(self, name: str, lo: int, hi: int) -> np.ndarray | None:
        """Canonical tensor `name`'s committed bits at flat positions lo .. hi (unsigned
        integers of its width), or None when this receiver does not hold them."""


class BitsByName:
    """A BaselineSource over arrays held by name: each tensor's whole old bits, flat (an
    offline decode, a benchmark, a test)."""

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self.arrays = arrays

    def bits(self, name: str, lo: int, hi: int) -> np.ndarray | None:
        a = self.arrays.get(name)
        return None if a is None else a[lo:hi]


def baseline_digest(bits: np.ndarray) -> str:
    """The digest a conditioned record carries of its universe's old bits (xxh3, 64 bits):
    a receiver holding other bits is told so before it decodes."""
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(bits).view(np.uint8))


def eligible(dt: dtypes.DType, op: Op) -> bool:
    """Whether records of this dtype and op can be coded conditioned."""
    return dt.name in CLASS_FIELDS and op in (Op.XOR, Op.ADD)


def encode_conditioned(pos: np.ndarray, vals: np.ndarray, dt: dtypes.DType, op: Op,
                       base: BaseSpan) -> tuple[bytes, bytes]:
    """(positions section, values section) of a record coded against `base`. Raises
    ValueError when a position lies outside the universe or is out of order."""
    if not eligible(dt, op):
        raise ValueError(f"conditioned coding needs a BF16/F16 xor or add record, got {dt.name} {op.value}")
    shift, cmask = CLASS_FIELDS[dt.name]
    ncls = cmask + 1
    k = int(pos.size)
    bits = np.ascontiguousarray(base.bits).view(np.uint16)
    cls = np.empty(k, np.int64)
    gaps = np.empty(k, np.int64)
    totals = np.zeros(ncls, np.int64)
    placed = kernels.conditioned.class_ranks(bits, np.int64(base.lo), pos, shift, cmask, cls, gaps, totals)
    if placed != k:
        raise ValueError(f"conditioned coding: positions must increase strictly within the universe "
                         f"[{base.lo}, {base.hi}); change #{placed} does not")
    kc = np.bincount(cls, minlength=ncls).astype(np.int64)
    m, nbits = _golomb_parameters(gaps, cls, kc, totals)
    nbytes = (nbits + 7) >> 3
    start = np.zeros(ncls, np.int64)
    start[1:] = np.cumsum(nbytes)[:-1]
    stream = np.zeros(int(nbytes.sum()), np.uint8)
    kernels.conditioned.golomb_write(gaps, cls, m, start << 3, stream, True)
    used = np.flatnonzero(kc)
    head = [leb128_ints(used.size)]
    prev = -1
    for c in used:
        head.append(leb128_ints(int(c) - prev - 1, int(kc[c]), int(m[c]), int(nbytes[c])))
        prev = int(c)
    psec = b"".join(head) + stream.tobytes()
    return psec, _encode_values(np.ascontiguousarray(vals).view(np.uint16), op is Op.ADD, cls, kc, ncls)


def _golomb_parameters(gaps: np.ndarray, cls: np.ndarray, kc: np.ndarray, totals: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Per class, the Golomb parameter that codes its gaps in the fewest bits among a few
    around the optimum for a geometric distribution of its change rate, and those bits; 0
    where every gap is 0 (the class's first elements all changed: no bits at all)."""
    ncls = kc.size
    base = np.ones(ncls, np.float64)
    for c in np.flatnonzero(kc):
        p = kc[c] / totals[c]
        if p < 1.0:
            base[c] = max(1.0, math.ceil(math.log(2.0 - p) / -math.log1p(-p)))
    best = np.zeros(ncls, np.int64)
    best_bits = np.full(ncls, np.iinfo(np.int64).max, np.int64)
    for f in _M_FACTORS:
        m = np.clip(np.rint(base * f), 1, MAX_GOLOMB).astype(np.int64)
        nb = np.zeros(ncls, np.int64)
        kernels.conditioned.golomb_write(gaps, cls, m, nb, _NO_BITS, False)
        better = nb < best_bits
        best[better], best_bits[better] = m[better], nb[better]
    zero_gaps = (np.bincount(cls, weights=gaps, minlength=ncls) == 0) & (kc > 0)
    best[zero_gaps], best_bits[zero_gaps] = 0, 0
    best_bits[kc == 0] = 0
    return best, best_bits


def _encode_values(vals: np.ndarray, add: bool, cls: np.ndarray, kc: np.ndarray, ncls: int) -> bytes:
    k = vals.size
    sym = np.empty(k, np.uint8)
    nesc = kernels.conditioned.value_symbols(vals, add, sym)
    counts = np.zeros((ncls, ALPHABET), np.int64)
    kernels.conditioned.symbol_counts(sym, cls, counts)
    starts = _value_groups(counts, kc)
    group_of = _group_of(starts, ncls)
    freq = np.zeros((len(starts), ALPHABET), np.int64)
    for g in range(len(starts)):
        freq[g] = _quantize(counts[group_of == g].sum(axis=0))
    cum = np.zeros_like(freq)
    cum[:, 1:] = np.cumsum(freq, axis=1)[:, :-1]
    words = np.empty(k + 2, np.uint16)
    first = kernels.conditioned.rans_encode(sym, cls, group_of, freq, cum, words)
    raw = np.empty(nesc, np.uint16)
    kernels.conditioned.escaped_values(vals, add, sym, raw)
    head = [leb128_ints(len(starts))]
    prev = -1
    for g, s in enumerate(starts):
        used = np.flatnonzero(freq[g])
        head.append(leb128_ints(s - prev - 1, used.size))
        prev = s
        last = -1
        for u in used:
            head.append(leb128_ints(int(u) - last - 1, int(freq[g, u]) - 1))
            last = int(u)
    head.append(leb128_ints(nesc, words.size - first))
    return b"".join(head) + words[first:].astype("<u2").tobytes() + raw.astype("<u2").tobytes()


def _value_groups(counts: np.ndarray, kc: np.ndarray) -> list[int]:
    """The classes each value group starts at: adjacent classes merged, in class order,
    until a group holds at least a minimum of changes; of a few minimums, the one whose
    groups' entropy plus table bytes is least."""
    used = np.flatnonzero(kc)
    best, best_cost = [int(used[0])] if used.size else [0], math.inf
    for gmin in _GROUP_MINS:
        starts, acc = [], 0
        for c in used:
            if not starts or acc >= gmin:
                starts.append(int(c))
                acc = 0
            acc += int(kc[c])
        if len(starts) > 1 and acc < gmin:  # a short tail joins the group before it
            starts.pop()
        group_of = _group_of(starts, counts.shape[0])
        cost = 0.0
        for g in range(len(starts)):
            merged = counts[group_of == g].sum(axis=0)
            nz = merged[merged > 0].astype(np.float64)
            cost += float((nz * np.log2(nz.sum() / nz)).sum()) + 8 * (2 + 2 * nz.size)
        if cost < best_cost:
            best, best_cost = starts, cost
    return best


def _group_of(starts: list[int], ncls: int) -> np.ndarray:
    """Per class, its value group: the last group starting at or below it (group 0 below all)."""
    marks = np.zeros(ncls, np.int64)
    marks[np.asarray(starts[1:], np.int64)] = 1
    return np.cumsum(marks)


def _quantize(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to SCALE, at least 1 for every symbol that occurs (all 0 for none)."""
    total = int(counts.sum())
    f = np.zeros(counts.size, np.int64)
    if total == 0:
        return f
    nz = counts > 0
    f[nz] = np.maximum(1, (counts[nz] * SCALE) // total)
    excess = int(f.sum()) - SCALE
    for s in np.argsort(-f, kind="stable"):
        if excess == 0:
            break
        if excess < 0:
            f[s] -= excess
            break
        take = min(excess, int(f[s]) - 1)
        f[s] -= take
        excess -= take
    return f


class ClassStreams(NamedTuple):
    """A conditioned positions section, parsed: per class its changes, Golomb parameter and
    where its stream starts and ends in `stream` (the streams, back to back)."""

    counts: np.ndarray
    m: np.ndarray
    start: np.ndarray
    end: np.ndarray
    stream: np.ndarray


def read_class_streams(psec: np.ndarray, count: int, ncls: int) -> ClassStreams:
    """The positions section's class table, every field checked (PositionsError otherwise)."""
    rd = Reader(psec)
    nused = rd.varint("conditioned positions: classes", ncls)
    kc = np.zeros(ncls, np.int64)
    m = np.zeros(ncls, np.int64)
    nbytes = np.zeros(ncls, np.int64)
    c = -1
    for _ in range(nused):
        c += 1 + rd.varint("conditioned positions: class", ncls)
        if c >= ncls:
            raise PositionsError(f"conditioned positions: class {c} >= {ncls}")
        kc[c] = rd.varint("conditioned positions: class changes", count)
        m[c] = rd.varint("conditioned positions: Golomb parameter", MAX_GOLOMB)
        nbytes[c] = rd.varint("conditioned positions: stream bytes", rd.left)
        if kc[c] == 0:
            raise PositionsError(f"conditioned positions: class {c} listed with no changes")
    if int(kc.sum()) != count:
        raise PositionsError(f"conditioned positions: classes hold {int(kc.sum())} changes, count is {count}")
    stream = rd.take(int(nbytes.sum()), "conditioned positions: streams")
    rd.done("conditioned positions")
    start = np.zeros(ncls, np.int64)
    start[1:] = np.cumsum(nbytes)[:-1]
    return ClassStreams(kc, m, start, start + nbytes, np.ascontiguousarray(stream))


def decode_conditioned(psec: np.ndarray, vsec: np.ndarray, count: int, dt: dtypes.DType, op: Op,
                       base: BaseSpan) -> tuple[np.ndarray, np.ndarray]:
    """(positions as uint64, values as 16-bit bits) of a conditioned record, decoded against
    the receiver's `base`. Raises PositionsError when the sections are malformed or do not
    fit this universe."""
    shift, cmask = CLASS_FIELDS[dt.name]
    ncls = cmask + 1
    streams = read_class_streams(psec, count, ncls)
    pos = np.empty(count, np.uint64)
    cls = np.empty(count, np.int64)
    bits = np.ascontiguousarray(base.bits).view(np.uint16)
    found = kernels.conditioned.golomb_positions(bits, np.int64(base.lo), shift, cmask, *streams, pos, cls)
    if found == -2:
        raise PositionsError("conditioned positions: more changes than the universe's elements of a class "
                             "(a baseline other than the producer's, or a corrupt section)")
    if found != count:
        raise PositionsError("conditioned positions: a class's Golomb stream is cut short or has trailing bits")
    return pos, _decode_values(vsec, count, op is Op.ADD, cls, ncls)


def _decode_values(vsec: np.ndarray, count: int, add: bool, cls: np.ndarray, ncls: int) -> np.ndarray:
    rd = Reader(vsec)
    ngroups = rd.varint("conditioned values: groups", ncls)
    if ngroups == 0:
        raise PositionsError("conditioned values: no value group")
    starts, s = [], -1
    freq = np.zeros((ngroups, ALPHABET), np.int64)
    for g in range(ngroups):
        s += 1 + rd.varint("conditioned values: group start", ncls)
        if s >= ncls:
            raise PositionsError(f"conditioned values: group starts at class {s} >= {ncls}")
        starts.append(s)
        nsym = rd.varint("conditioned values: table size", ALPHABET)
        u = -1
        for _ in range(nsym):
            u += 1 + rd.varint("conditioned values: symbol", ALPHABET)
            if u >= ALPHABET:
                raise PositionsError(f"conditioned values: symbol {u} >= {ALPHABET}")
            freq[g, u] = 1 + rd.varint("conditioned values: frequency", SCALE - 1)
        if int(freq[g].sum()) != SCALE:
            raise PositionsError(f"conditioned values: group {g}'s frequencies sum to {int(freq[g].sum())}, "
                                 f"not {SCALE}")
    nesc = rd.varint("conditioned values: escapes", count)
    nwords = rd.varint("conditioned values: words", count + 2)
    words = rd.take(2 * nwords, "conditioned values: rANS words").view("<u2").astype(np.uint16)
    raw = rd.take(2 * nesc, "conditioned values: escaped values").view("<u2").astype(np.uint16)
    rd.done("conditioned values")
    group_of = _group_of(starts, ncls)
    cum = np.zeros_like(freq)
    cum[:, 1:] = np.cumsum(freq, axis=1)[:, :-1]
    lookup = np.repeat(np.tile(np.arange(ALPHABET, dtype=np.uint8), (ngroups, 1)).ravel(),
                       freq.ravel()).reshape(ngroups, SCALE)
    sym = np.empty(count, np.uint8)
    if kernels.conditioned.rans_decode(words, cls, group_of, freq, cum, lookup, sym) != 0:
        raise PositionsError("conditioned values: the rANS stream is cut short, too long or corrupt")
    vals = np.empty(count, np.uint16)
    used = kernels.conditioned.value_bits(sym, raw, add, vals)
    if used != nesc:
        raise PositionsError(f"conditioned values: {nesc} escaped values declared, the stream uses "
                             f"{used if used >= 0 else 'a literal as an escape or more'}")
    return vals
