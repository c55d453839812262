"""Wire codec, formats v5 and v6: `Payload` <-> bytes. The full spec is docs/wire-format.md.

Byte layout (all integers little-endian):

    offset          size   field
    0               4      magic b"NDCR"
    4               2      u16 format version: 5 (the host format) or 6 (the device format)
    6               2      u16 flags; bit 0 = HMAC present, other bits must be 0
    8               4      u32 header length H
    12              H      header: JSON, UTF-8, sorted keys, no whitespace
    12+H            B      body: sections, back to back, in record order
                           (each record: positions section, then values section)
    12+H+B          16     XXH3-128 of bytes [0, 12+H+B), xxh3_128_digest (big-endian)
    12+H+B+16       32     HMAC-SHA256 of bytes [0, 12+H+B+16)   (only if flag bit 0)

B is `body_bytes` in the header. Each non-empty section is either stored (its header
entry says "stored": true; its raw bytes, length == raw_length) or exactly one zstd
frame that declares its content size; an empty section (raw length 0) has no bytes at all.
The encoder stores the rANS-coded sections (incompressible: zstd would only cost time)
and compresses the others.

Encodings: positions `gaps_rans` (entropy-coded gaps: rANS-coded Rice quotients plus
raw low bits), `runs` (v1's run varints), `all`, `dense` (xor/add values at every element,
zeros dropped on decode); values `symbols_rans` (a rANS-coded table of distinct values
plus escapes) or `planes` (v1's byte planes); and, from v5, `gaps_joint` + `symbols_joint`
(the same sections with the quotients and value symbols in one rANS stream, one symbol
per change: `nemo_dcr.joint`); and, in v6, `gaps_prefix` + `symbols_prefix` (the same as
one bit stream of prefix codes, coded with torch ops on the device that holds the record's
tensors: `nemo_dcr.prefix`). The encoder picks, per record, whichever is smallest on
the wire (the joint stream by an estimate of what it adds; the prefix stream for records
handed over as tensors, in v6); the decoded `Record` does not depend on that choice.
v2's constriction-coded `gaps` / `symbols` are unknown encodings.

`decode` validates everything - framing, checksum, HMAC, header schema, sizes, limits,
every position and value - before it returns, so a receiver can reject a payload
before it writes a byte. Every failure is a `PayloadRejected` naming the payload and
the reason. Nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import struct
import threading
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
import xxhash
import zstandard

from . import dtypes
from .errors import PayloadRejected
from . import kernels
from . import prefix
from .joint import decode_joint_gaps, encode_joint
from .positions import (
    MAX_NUMEL,
    GapsParts,
    GapsReader,
    PositionsError,
    RansStream,
    Reader,
    check_positions,
    chunks_size,
    decode_rans_pair,
    decode_runs,
    encode_gaps_rans,
    encode_rans_chunks,
    encode_rans_pair,
    encode_runs,
    entropy_bits,
    gaps_parts,
    leb128_ints,
    read_model,
)
from .records import Op, Payload, PayloadHeader, Record
from .wire_versions import (DEVICE_FORMAT, FORMAT_VERSION, HOST_FORMAT, WRITABLE_VERSIONS, readable_versions_text,
                            writable_versions_text)

MAGIC = b"NDCR"
FLAG_HMAC = 0x0001
_PREFIX = struct.Struct("<4sHHI")
PREFIX_BYTES = _PREFIX.size  # 12
CHECKSUM_BYTES = 16
HMAC_BYTES = 32

POSITION_ENCODINGS = ("gaps_rans", "gaps_joint", "gaps_prefix", "runs", "all", "dense")
VALUE_ENCODINGS = ("symbols_rans", "symbols_joint", "symbols_prefix", "planes")
# v5: a record's positions and values as one rANS stream (nemo_dcr.joint); always together.
_JOINT = ("gaps_joint", "symbols_joint")
# v6: the same as one prefix-coded bit stream, coded where the record's tensors are
# (nemo_dcr.prefix); always together.
_PREFIX_CODED = ("gaps_prefix", "symbols_prefix")
# The pairs of encodings that only come together, positions first.
_PAIRED = (_JOINT, _PREFIX_CODED)
# Literal values a `symbols_rans` table may hold (one more symbol escapes to raw values).
VALUE_ALPHABET = 1024
# Records of at most this many changes also try the simple v1 encodings (runs, planes).
_SMALL = 64

_ZSTD_FRAME_MAGIC = b"\x28\xb5\x2f\xfd"
# Frames we write use far smaller windows (level 19: 8 MiB); a larger declared window
# is refused rather than allocated.
_MAX_WINDOW = 1 << 27
_GiB = 1 << 30

_TOP_KEYS = frozenset(
    {"base_version", "body_bytes", "payload_id", "producer_id", "raw_bytes", "records",
     "target_version", "transfer_id"}
)
_RECORD_KEYS = frozenset({"count", "dtype", "name", "op", "positions", "shape", "values"})
_OPS = {op.value: op for op in Op}
_SECTION_KEYS = frozenset({"offset", "length", "raw_length"})
# A section may say "stored": true (raw bytes, no zstd frame); omitted otherwise, so that
# each section has one spelling. Only `true` is valid.
_STORED = "stored"
_STORED_ONLY = frozenset({_STORED})
# What the encoder stores raw: rANS output is incompressible, zstd would only cost time.
_STORED_ENCODINGS = frozenset({"gaps_rans", "symbols_rans", *_JOINT, *_PREFIX_CODED})
_POSITION_KEYS = {"runs": _SECTION_KEYS | {"encoding"}, "gaps_rans": _SECTION_KEYS | {"encoding"},
                  "gaps_joint": _SECTION_KEYS | {"encoding"}, "gaps_prefix": _SECTION_KEYS | {"encoding"},
                  "all": frozenset({"encoding"}), "dense": frozenset({"encoding"})}
_VALUE_KEYS = {"planes": _SECTION_KEYS | {"encoding", "width"},
               "symbols_rans": _SECTION_KEYS | {"encoding", "width"},
               "symbols_joint": _SECTION_KEYS | {"encoding", "width"},
               "symbols_prefix": _SECTION_KEYS | {"encoding", "width"}}


@dataclass(frozen=True)
class _Version:
    """What differs between the format versions `decode` reads."""

    prefix: bool = False  # whether records may use the prefix encodings (gaps_prefix / symbols_prefix)


# The host format and the device format; nothing older is read (none was released).
_VERSIONS = {HOST_FORMAT: _Version(), DEVICE_FORMAT: _Version(prefix=True)}


def _checksum(*parts: Any) -> bytes:
    """XXH3-128 of bytes [0, 12+H+B), given as one or more consecutive parts (hashed as they
    are, not joined first); CHECKSUM_BYTES long. Why XXH3: an integrity check only (the HMAC
    authenticates), and it runs at tens of GB/s."""
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class DecodeLimits:
    """Receiver-side bounds; anything larger is rejected before it is allocated.

    Raw sizes are decoded sizes: a section's uncompressed bytes, and for positions
    also the decoded index array (8 bytes per position), so a tiny "runs" section
    cannot expand into an unbounded array.
    """

    max_payload_bytes: int = 4 * _GiB
    max_raw_bytes: int = 4 * _GiB  # per section (and per record's decoded positions)
    max_records: int = 1 << 20
    max_header_bytes: int = 64 << 20
    max_total_raw_bytes: int = 16 * _GiB  # everything one decode may materialise


@dataclass(frozen=True)
class Expected:
    """What the receiver expects this payload to belong to; None = don't check."""

    transfer_id: str | None = None
    base_version: int | None = None
    target_version: int | None = None


@dataclass(frozen=True)
class _Section:
    offset: int
    length: int
    raw_length: int
    stored: bool = False  # raw bytes in the body, else one zstd frame


@dataclass(frozen=True)
class _RecordMeta:
    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    numel: int
    op: Op
    count: int
    positions_encoding: str
    positions: _Section | None
    values: _Section
    values_encoding: str = "planes"


class _Bad(Exception):
    """Internal: a validation failure; `decode` re-raises it as PayloadRejected."""


class _Rejecting:
    """Context: any failure inside becomes PayloadRejected(pid, reason)."""

    def __init__(self) -> None:
        self.pid: str | None = None  # set as soon as the header names the payload

    def __enter__(self) -> _Rejecting:
        return self

    def __exit__(self, et: Any, e: BaseException | None, tb: Any) -> None:
        if e is None or isinstance(e, PayloadRejected) or not isinstance(e, Exception):
            return  # propagate unchanged (None: never swallow)
        if isinstance(e, (_Bad, PositionsError)):
            raise PayloadRejected(self.pid, str(e)) from None
        # Safety net: malformed input must never escape as another exception type.
        raise PayloadRejected(self.pid, f"malformed payload ({type(e).__name__}: {e})") from e


# ======================================================================== encode


def encode(payload: Payload, *, key: bytes | None = None, level: int = 1, dense: str = "auto",
           version: int = FORMAT_VERSION) -> bytes:
    """Serialize `payload` (format v5, or `version` 6). Raises ValueError on an invalid payload.

    key: HMAC-SHA256 key; when given the payload is signed (flag bit 0).
    level: zstd compression level for every section that is not stored raw.
    dense: "auto" sends an xor/add record densely (every element's value, zeros
           included) when that is smaller on the wire; "never" / "always" force it
           (for benchmarks). The decoded record is the same either way.
    version: 5, the host format, or 6, the device format (experimental): records whose
           positions and values are torch tensors are then coded where they are, with
           prefix codes (`gaps_prefix` / `symbols_prefix`, nemo_dcr.prefix: a GPU codes
           them itself); the rest as version 5 codes them. With 5, tensors are copied to
           the host and coded there.
    """
    if dense not in ("auto", "never", "always"):
        raise ValueError(f"dense must be 'auto', 'never' or 'always', got {dense!r}")
    if version not in WRITABLE_VERSIONS:
        raise ValueError(f"version must be {writable_versions_text()} (the versions this encoder writes), "
                         f"got {version!r}")
    h = payload.header
    _check_identity(h, ValueError)
    if h.target_version == h.base_version and any(Op(r.op) is not Op.OVERWRITE for r in payload.records):
        raise ValueError(f"header: base_version == target_version {h.base_version} (an anchor) but a record "
                         "is not an overwrite")
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
    sections: list[bytes] = []
    metas: list[dict[str, Any]] = []
    seen: dict[str, list[Record]] = {}
    cursor = raw_total = 0

    def place(choice: _Choice | None) -> dict[str, Any]:
        nonlocal cursor, raw_total
        if choice is None:
            return {}
        sec: dict[str, Any] = {"offset": cursor, "length": choice.size, "raw_length": choice.raw_length}
        if choice.stored:
            sec[_STORED] = True
        sections.extend(choice.frame)
        cursor += choice.size
        raw_total += choice.raw_length
        return sec

    for index, r in enumerate(payload.records):
        where = f"record {r.name!r}"
        if not isinstance(r.name, str) or not r.name:
            raise ValueError(f"{where}: name must be a non-empty string")
        dt = dtypes.from_name(r.dtype)
        op = r.op if type(r.op) is Op else Op(r.op)
        shape = tuple(r.shape)
        if not all(type(s) is int for s in shape):  # numpy integers too, as ints
            if not all(isinstance(s, np.integer) or type(s) is int for s in shape):
                raise ValueError(f"{where}: shape {shape!r} must hold integers")
            shape = tuple(int(s) for s in shape)
        numel = _numel(shape)
        if numel is None:
            raise ValueError(f"{where}: shape {shape} has a negative dim or > 2**63 elements")
        coded = None
        if isinstance(r.positions, torch.Tensor) or isinstance(r.values, torch.Tensor):
            r, coded = _tensor_record(r, dt, numel, where, _VERSIONS[version].prefix, cctx)
        if coded is not None:
            pos, vals, (pchoice, vchoice) = r.positions, r.values, coded
        else:
            pos = _positions_unsigned(r.positions, where)
            gaps = None
            if _PAIR_MIN <= pos.size < numel:
                # Coded as gaps: splitting them checks the order on the way (one pass fewer);
                # when it fails, check_positions says what is wrong.
                gaps = gaps_parts(pos, reuse=True) if pos.ndim == 1 else None
                why = check_positions(pos, numel) if gaps is None or int(pos[-1]) >= numel else None
            else:
                why = check_positions(pos, numel)
            if why:
                raise ValueError(f"{where}: {why}")
            vals = _values_bits(r.values, dt, where)
            if vals.shape[0] != pos.shape[0]:
                raise ValueError(f"{where}: {vals.shape[0]} values for {pos.shape[0]} positions")
            pchoice, vchoice = _encode_record(pos, vals, dt, op, numel, cctx, dense, where, gaps)
        count = int(pos.shape[0])
        pmeta = {"encoding": pchoice.encoding, **place(pchoice if pchoice.frame is not None else None)}
        vmeta = {"encoding": vchoice.encoding, "width": dt.itemsize, **place(vchoice)}
        metas.append({"name": r.name, "dtype": dt.name, "shape": list(shape), "op": op.value,
                      "count": count, "positions": pmeta, "values": vmeta})
        for other in seen.get(r.name, []):
            if other.dtype != r.dtype or tuple(other.shape) != shape:
                raise ValueError(f"{where} appears twice with different dtype/shape")
        seen.setdefault(r.name, []).append(Record(r.name, dt.name, shape, op, pos, vals))
    for name, recs in seen.items():
        if len(recs) > 1 and _overlap([r.positions for r in recs]):
            raise ValueError(f"record {name!r} appears more than once with overlapping positions")

    header = {"transfer_id": h.transfer_id, "base_version": h.base_version,
              "target_version": h.target_version, "producer_id": h.producer_id,
              "payload_id": h.payload_id, "raw_bytes": raw_total, "body_bytes": cursor,
              "records": metas}
    hbytes = json.dumps(header, sort_keys=True, separators=(",", ":"),
                        ensure_ascii=False).encode("utf-8")
    flags = FLAG_HMAC if key is not None else 0
    # Checksum and HMAC over the parts as they are, then one join: no whole-payload copies.
    parts = [_PREFIX.pack(MAGIC, version, flags, len(hbytes)), hbytes, *sections]
    parts.append(_checksum(*parts))
    if key is not None:
        mac = hmac.new(_key_bytes(key), digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        parts.append(mac.digest())
    return b"".join(parts)


@dataclass(frozen=True)
class _Choice:
    encoding: str
    frame: list | None  # the section's bytes on the wire, as chunks; None: no section ("all" / "dense")
    raw_length: int = 0
    stored: bool = False  # frame is the raw section itself, not a zstd frame
    size: int = 0  # bytes on the wire


def _frame(encoding: str, raw: bytes | list, cctx: zstandard.ZstdCompressor) -> _Choice:
    """The section of a raw one (bytes, or chunks as the rANS encoders give them)."""
    length = chunks_size(raw) if isinstance(raw, list) else len(raw)
    if not length:
        return _Choice(encoding, [], 0)
    if encoding in _STORED_ENCODINGS:  # stored as it is: its chunks join the payload once
        return _Choice(encoding, raw if isinstance(raw, list) else [raw], length, stored=True, size=length)
    frame = cctx.compress(b"".join(raw) if isinstance(raw, list) else raw)
    return _Choice(encoding, [frame], length, size=len(frame))


# Records of at least this many changes code their positions' and values' rANS streams
# in one pass (positions.encode_rans_pair); the bytes are the same either way.
_PAIR_MIN = 4096


def _encode_record(pos: np.ndarray, vals: np.ndarray, dt: dtypes.DType, op: Op, numel: int,
                   cctx: zstandard.ZstdCompressor, dense: str, where: str,
                   gp: GapsParts | None = None) -> tuple[_Choice, _Choice]:
    """(positions, values) sections of one record: the smallest of the encodings that fit.
    gp: gaps_parts(pos), when already computed."""
    count = int(pos.size)
    if count == 0:  # no changes: an empty runs section and an empty planes section
        return _Choice("runs", [], 0), _Choice("planes", [], 0)
    if count == numel:
        return _Choice("all", None), _best_values(vals, dt, cctx)
    if count >= _PAIR_MIN:
        # Both raw sections at once: gaps and value symbols first, then one joint stream
        # (nemo_dcr.joint) when neither runs nor planes could be smaller, else their two
        # rANS streams in one pass and the same choices as below.
        gp = gaps_parts(pos, reuse=True) if gp is None else gp
        vp = value_parts(vals, dt.itemsize)
        joint = None
        if vp is not None and not _runs_worth_trying(count, gp.zeros):
            joint = encode_joint(gp, vp, count * dt.itemsize // 2)  # over that, planes are tried
        if joint is not None:
            pchoice, vchoice = _frame("gaps_joint", joint[0], cctx), _frame("symbols_joint", joint[1], cctx)
        else:
            if vp is None:
                graw, vraw = gp.chunks(encode_rans_chunks(gp.sym, gp.counts)), None
            else:
                grans, vrans = encode_rans_pair(gp.sym, gp.counts, vp.sym, vp.counts, vp.lut)
                graw, vraw = gp.chunks(grans), vp.chunks(vrans)
            pchoice = _best_positions(pos, cctx, (graw, gp.zeros))
            vchoice = _best_values(vals, dt, cctx, raw=vraw)
    else:
        pchoice = _best_positions(pos, cctx)
        vchoice = _best_values(vals, dt, cctx)
    if dense == "never" or op is Op.OVERWRITE:
        return pchoice, vchoice
    # Dense: every element's xor/add value (0 where nothing changed); only plausible
    # at high change rates, so "auto" tries it from 1 change in 16 elements up.
    if dense == "always" or (count * 16 >= numel and numel <= (1 << 31)):
        full = np.zeros(numel, dtype=dt.bits_numpy)
        full[pos.astype(np.int64)] = vals
        if np.count_nonzero(full) != count:
            if dense == "always":
                raise ValueError(f"{where}: a dense {op.value} record cannot carry a zero value")
            return pchoice, vchoice
        dchoice = _best_values(full, dt, cctx)
        if dense == "always" or dchoice.size < pchoice.size + vchoice.size:
            return _Choice("dense", None), dchoice
    return pchoice, vchoice


def _best_positions(pos: np.ndarray, cctx: zstandard.ZstdCompressor,
                    gaps: tuple[bytes | list, int] | None = None) -> _Choice:
    """gaps: encode_gaps_rans(pos) (its section as bytes or chunks), if already computed."""
    count = pos.size
    raw, adjacent = encode_gaps_rans(pos) if gaps is None else gaps
    best = _frame("gaps_rans", raw, cctx)
    if _runs_worth_trying(count, adjacent):
        runs = _frame("runs", encode_runs(pos), cctx)
        if runs.size <= best.size:
            best = runs
    return best


def _runs_worth_trying(count: int, adjacent: int) -> bool:
    """Whether `runs` might code these positions smaller than their gaps: tiny records,
    and records whose positions are mostly adjacent to the previous one."""
    return count <= _SMALL or (count - 1 - adjacent) < count // 2


_UNSET: Any = object()


def _best_values(vals: np.ndarray, dt: dtypes.DType, cctx: zstandard.ZstdCompressor, *,
                 raw: bytes | list | None = _UNSET) -> _Choice:
    """raw: encode_value_symbols(vals, itemsize) (bytes or chunks), if already computed (None included)."""
    if raw is _UNSET:
        raw = encode_value_symbols(vals, dt.itemsize)
    best = _frame("symbols_rans", raw, cctx) if raw is not None else None
    if best is None or vals.size <= _SMALL or best.size > vals.size * dt.itemsize // 2:
        planes = np.ascontiguousarray(vals.view(np.uint8).reshape(vals.size, dt.itemsize).T)
        alt = _frame("planes", planes.tobytes(), cctx)
        if best is None or alt.size <= best.size:
            best = alt
    return best


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
        rANS stream              one symbol per value, alphabet L + E (positions.encode_rans)
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
    v = _ValuesReader(raw, m, dt, where)
    return v.values(v.stream.decode(m))


class _ValuesReader:
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


# Integer views of a tensor's value bits by width, for the prefix coder (nemo_dcr.prefix).
_TORCH_BITS = {1: torch.uint8, 2: torch.int16}


def _tensor_record(r: Record, dt: dtypes.DType, numel: int, where: str, prefix_ok: bool,
                   cctx: zstandard.ZstdCompressor) -> tuple[Record, tuple[_Choice, _Choice] | None]:
    """A record whose positions and values are torch tensors (on any one device): coded
    where they are, as `gaps_prefix` + `symbols_prefix` (nemo_dcr.prefix), when the
    payload's version has them (prefix_ok: 6) and the record is one the host would code
    as gaps and symbols (>= _PAIR_MIN changes, fewer than one in 16 elements, 1- or 2-byte
    values, not most of them escaping): (the record with int64 positions and value bits,
    its two sections). Otherwise (the record with its arrays copied to the host, None),
    for the host's encodings."""
    pos, vals = r.positions, r.values
    if not (isinstance(pos, torch.Tensor) and isinstance(vals, torch.Tensor)) or pos.device != vals.device:
        raise ValueError(f"{where}: positions and values must be two tensors on one device, or two arrays")
    if pos.dim() != 1 or vals.dim() != 1:
        raise ValueError(f"{where}: positions and values must be 1-D, got shapes {tuple(pos.shape)} / "
                         f"{tuple(vals.shape)}")
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise ValueError(f"{where}: positions must be integers, got {pos.dtype}")
    if vals.dtype.is_floating_point or vals.dtype.is_complex or vals.element_size() != dt.itemsize:
        raise ValueError(f"{where}: value width/dtype {vals.dtype} does not match {dt.name} "
                         f"(expected {dt.itemsize}-byte integer bits)")
    if vals.numel() != pos.numel():
        raise ValueError(f"{where}: {vals.numel()} values for {pos.numel()} positions")
    count = pos.numel()
    if prefix_ok and dt.itemsize in _TORCH_BITS and _PAIR_MIN <= count and count * 16 < numel:
        p64 = pos.to(torch.int64)
        why = prefix.check_order(p64, numel)
        if why:
            raise ValueError(f"{where}: {why}")
        bits = vals.view(_TORCH_BITS[dt.itemsize])
        distinct, counts = prefix.value_counts(bits, dt.itemsize)
        chosen = value_table(distinct, counts, count)
        if chosen is not None:
            psec, vsec = prefix.encode_prefix(p64, bits, dt.itemsize, *chosen)
            coded = Record(r.name, dt.name, r.shape, r.op, p64, bits)
            return coded, (_frame("gaps_prefix", psec, cctx), _frame("symbols_prefix", vsec, cctx))
    return Record(r.name, r.dtype, r.shape, r.op, pos.cpu().numpy(), vals.cpu().numpy()), None


_HOST_POSITIONS = (np.dtype("<u8"), np.dtype("<u4"))


def _positions_unsigned(positions: Any, where: str) -> np.ndarray:
    """uint64 positions, or uint32 ones as they are (the producer's in-place pieces give
    those: a copy to uint64 would cost a pass; the bytes on the wire are the same)."""
    if type(positions) is np.ndarray and positions.dtype in _HOST_POSITIONS and positions.ndim == 1 \
            and positions.flags.c_contiguous:
        return positions  # the producer's: as they are (the checks below pass them unchanged)
    p = np.asarray(positions)
    if p.ndim != 1:
        raise ValueError(f"{where}: positions must be 1-D, got shape {p.shape}")
    if p.size and p.dtype.kind not in "ui":
        raise ValueError(f"{where}: positions must be integers, got {p.dtype}")
    if p.size and p.dtype.kind == "i" and int(p.min()) < 0:
        raise ValueError(f"{where}: negative position")
    if p.dtype == np.uint32:
        return np.ascontiguousarray(p.astype("<u4", copy=False))
    return np.ascontiguousarray(p, dtype=np.uint64)


def _values_bits(values: Any, dt: dtypes.DType, where: str) -> np.ndarray:
    bits = dt.bits_numpy
    if type(values) is np.ndarray and values.dtype == bits and values.ndim == 1 and values.flags.c_contiguous:
        return values  # the producer's: as they are (the checks below pass them unchanged)
    v = np.asarray(values)
    if v.ndim != 1:
        raise ValueError(f"{where}: values must be 1-D, got shape {v.shape}")
    if v.dtype.kind not in "uib" or v.dtype.itemsize != dt.itemsize:
        raise ValueError(f"{where}: value width/dtype {v.dtype} does not match "
                         f"{dt.name} (expected {dt.bits_numpy})")
    if v.dtype.kind != "b":
        v = v.astype(v.dtype.newbyteorder("<"), copy=False)
    return np.ascontiguousarray(v).view(bits)


def _key_bytes(key: bytes) -> bytes:
    k = bytes(key)
    if not k:
        raise ValueError("empty HMAC key")
    return k


# ======================================================================== decode


def decode(
    data: bytes | memoryview,
    *,
    key: bytes | None = None,
    catalog: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
    expected: Expected | None = None,
    limits: DecodeLimits = DecodeLimits(),
) -> Payload:
    """Validate and decode a payload (format v5 or v6); raise PayloadRejected(payload_id, reason) if bad.

    key: when given the payload must carry a valid HMAC; a signed payload is also
         rejected when no key is given (it cannot be verified).
    catalog: canonical name -> (dtype name, shape) the receiver serves.
    expected: transfer id / versions the receiver is waiting for.
    """
    kbytes = _key_bytes(key) if key is not None else None
    mv = _as_bytes_view(data)
    with _Rejecting() as guard:
        version, flags, hlen, body_len = _parse_prefix(mv, limits)
        hbytes = bytes(mv[PREFIX_BYTES:PREFIX_BYTES + hlen])
        guard.pid, declared_body = _sniff(hbytes)
        if declared_body is not None and declared_body != body_len:
            want = len(mv) - body_len + declared_body
            why = "truncated" if want > len(mv) else "trailing bytes"
            raise _Bad(f"{why}: header declares a {want}-byte payload, got {len(mv)} bytes")
        end = PREFIX_BYTES + hlen + body_len
        if not hmac.compare_digest(_checksum(mv[:end]), mv[end:end + CHECKSUM_BYTES]):
            raise _Bad("checksum mismatch (XXH3-128): payload corrupt or truncated")
        signed = bool(flags & FLAG_HMAC)
        if signed and kbytes is None:
            raise _Bad("payload carries an HMAC but no key is configured to verify it")
        if kbytes is not None:
            if not signed:
                raise _Bad("HMAC missing: a key is configured but the payload is unsigned")
            end += CHECKSUM_BYTES
            mac = hmac.new(kbytes, mv[:end], hashlib.sha256).digest()
            if not hmac.compare_digest(mac, mv[end:end + HMAC_BYTES]):
                raise _Bad("HMAC mismatch: payload forged or signed with another key")
        header, metas = _parse_header(hbytes, body_len, limits, version)
        guard.pid = header.payload_id
        _check_expected(header, expected)
        _check_catalog(metas, catalog)
        # Read-only: stored sections are read in place, and nothing here may write to the caller's buffer.
        body = mv[PREFIX_BYTES + hlen:PREFIX_BYTES + hlen + body_len].toreadonly()
        dctx = zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW)
        records = [_decode_record(m, body, dctx) for m in metas]
        _check_no_overlap(records)
        return Payload(header=header, records=records)


def peek_header(data: bytes | memoryview, *, limits: DecodeLimits = DecodeLimits()) -> PayloadHeader:
    """The payload's identity, for dedup and routing, without touching the body.

    Checks magic, version, flags, lengths and the header schema; does NOT verify the
    checksum or HMAC, so the result is untrusted until `decode` accepts the payload.
    """
    mv = _as_bytes_view(data)
    with _Rejecting() as guard:
        version, _, hlen, body_len = _parse_prefix(mv, limits)
        hbytes = bytes(mv[PREFIX_BYTES:PREFIX_BYTES + hlen])
        guard.pid, _ = _sniff(hbytes)
        header, _ = _parse_header(hbytes, body_len, limits, version)
        return header


def _as_bytes_view(data: Any) -> memoryview:
    try:
        mv = memoryview(data)
        return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    except TypeError as e:
        raise PayloadRejected(None, f"payload must be contiguous bytes ({e})") from None


def _parse_prefix(mv: memoryview, limits: DecodeLimits) -> tuple[_Version, int, int, int]:
    """(version, flags, header length, body length) from the fixed prefix and total length."""
    n = len(mv)
    if n > limits.max_payload_bytes:
        raise _Bad(f"payload of {n} bytes exceeds limit max_payload_bytes={limits.max_payload_bytes}")
    if n >= 4 and bytes(mv[:4]) != MAGIC:
        raise _Bad(f"bad magic {bytes(mv[:4])!r} (expected {MAGIC!r})")
    if n < PREFIX_BYTES:
        raise _Bad(f"truncated: {n} bytes, shorter than the {PREFIX_BYTES}-byte prefix")
    _, number, flags, hlen = _PREFIX.unpack(mv[:PREFIX_BYTES])
    version = _VERSIONS.get(number)
    if version is None:
        raise _Bad(f"unsupported format version {number} (this decoder reads {readable_versions_text()})")
    if flags & ~FLAG_HMAC:
        raise _Bad(f"unknown flag bits 0x{flags & ~FLAG_HMAC:04x}")
    if hlen > limits.max_header_bytes:
        raise _Bad(f"header of {hlen} bytes exceeds limit max_header_bytes={limits.max_header_bytes}")
    trailer = CHECKSUM_BYTES + (HMAC_BYTES if flags & FLAG_HMAC else 0)
    body_len = n - PREFIX_BYTES - hlen - trailer
    if body_len < 0:
        raise _Bad(f"truncated: {n} bytes cannot hold the {hlen}-byte header and {trailer}-byte trailer")
    return version, flags, hlen, body_len


def _sniff(hbytes: bytes) -> tuple[str | None, int | None]:
    """Best effort (payload_id, body_bytes) for error messages before full validation."""
    try:
        h = json.loads(hbytes.decode("utf-8"))
    except Exception:
        return None, None
    if not isinstance(h, dict):
        return None, None
    pid = h.get("payload_id")
    body = h.get("body_bytes")
    return (pid if isinstance(pid, str) else None,
            body if type(body) is int and body >= 0 else None)


# ---------------------------------------------------------------- header schema


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise _Bad("malformed header JSON: duplicate key")
    return d


def _reject_constant(name: str) -> Any:
    raise _Bad(f"malformed header JSON: non-standard constant {name}")


def _fields(obj: Any, keys: frozenset[str], where: str, optional: frozenset[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise _Bad(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if obj.keys() == keys:  # exactly the fields, as a payload has them: no set arithmetic
        return obj
    missing = keys - obj.keys()
    extra = obj.keys() - keys - optional
    if missing:
        raise _Bad(f"{where}: missing field(s) {sorted(missing)}")
    if extra:
        raise _Bad(f"{where}: unknown field(s) {sorted(extra)}")
    return obj


# The checks below take the field's name apart from where it is (`what`) and join them only
# for an error: a header's ~20 messages a record, built up front, cost ~3 us a record.


def _at(where: str, what: str) -> str:
    return f"{where} {what}" if what else where


def _int(v: Any, where: str, what: str = "") -> int:
    if type(v) is not int:
        raise _Bad(f"{_at(where, what)}: expected an integer, got {type(v).__name__}")
    if v < 0:
        raise _Bad(f"{_at(where, what)}: negative value {v}")
    return v


def _str(v: Any, where: str, what: str = "") -> str:
    if not isinstance(v, str) or not v:
        raise _Bad(f"{_at(where, what)}: expected a non-empty string, got {type(v).__name__}")
    return v


def _numel(shape: tuple[int, ...]) -> int | None:
    n = 1
    for s in shape:
        if s < 0 or s > MAX_NUMEL:
            return None
        n *= s
        if n > MAX_NUMEL:
            return None
    return n


def _check_identity(h: PayloadHeader, exc: type[Exception]) -> None:
    for f in ("transfer_id", "producer_id", "payload_id"):
        v = getattr(h, f)
        if not isinstance(v, str) or not v:
            raise exc(f"header {f}: expected a non-empty string, got {v!r}")
    for f in ("base_version", "target_version"):
        v = getattr(h, f)
        if type(v) is not int or v < 0:
            raise exc(f"header {f}: expected a non-negative integer, got {v!r}")
    if h.target_version < h.base_version:
        raise exc(f"header: target_version {h.target_version} must be >= base_version {h.base_version}")


def _parse_header(hbytes: bytes, body_len: int, limits: DecodeLimits, version: _Version
                  ) -> tuple[PayloadHeader, list[_RecordMeta]]:
    try:
        text = hbytes.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Bad(f"malformed header: not UTF-8 ({e.reason})") from None
    try:
        raw = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise _Bad(f"malformed header JSON: {e}") from None
    top = _fields(raw, _TOP_KEYS, "header")
    header = PayloadHeader(
        transfer_id=_str(top["transfer_id"], "header transfer_id"),
        base_version=_int(top["base_version"], "header base_version"),
        target_version=_int(top["target_version"], "header target_version"),
        producer_id=_str(top["producer_id"], "header producer_id"),
        payload_id=_str(top["payload_id"], "header payload_id"),
    )
    _check_identity(header, _Bad)
    if _int(top["body_bytes"], "header body_bytes") != body_len:
        raise _Bad(f"declared body_bytes {top['body_bytes']} != actual body {body_len}")
    declared_raw = _int(top["raw_bytes"], "header raw_bytes")
    recs = top["records"]
    if not isinstance(recs, list):
        raise _Bad("header records: expected a list")
    if len(recs) > limits.max_records:
        raise _Bad(f"{len(recs)} records exceed limit max_records={limits.max_records}")
    metas: list[_RecordMeta] = []
    cursor = raw_sum = decoded = 0
    for i, rec in enumerate(recs):
        m, cursor, raw, dec = _parse_record(rec, i, cursor, limits, version)
        metas.append(m)
        raw_sum += raw
        decoded += dec
    if cursor != body_len:
        raise _Bad(f"sections cover {cursor} bytes but the body has {body_len}")
    if raw_sum != declared_raw:
        raise _Bad(f"declared raw_bytes {declared_raw} != sum of section raw lengths {raw_sum}")
    if decoded > limits.max_total_raw_bytes:
        raise _Bad(f"decoded size {decoded} exceeds limit max_total_raw_bytes={limits.max_total_raw_bytes}")
    if header.target_version == header.base_version and any(m.op is not Op.OVERWRITE for m in metas):
        # A payload that keeps its version is an anchor (nemo_dcr.history): it states bits, never changes them.
        raise _Bad(f"header: base_version == target_version {header.base_version} (an anchor) "
                   "but a record is not an overwrite")
    return header, metas


def _section(obj: dict[str, Any], where: str, cursor: int, limits: DecodeLimits) -> _Section:
    """The section an object names; its field set was checked by `_fields`."""
    stored = _STORED in obj
    if stored and obj[_STORED] is not True:
        raise _Bad(f"{where} stored: expected true (a zstd section omits the field), got {obj[_STORED]!r}")
    s = _Section(_int(obj["offset"], where, "offset"), _int(obj["length"], where, "length"),
                 _int(obj["raw_length"], where, "raw_length"), stored)
    if s.offset != cursor:
        raise _Bad(f"{where}: offset {s.offset} != expected {cursor} (sections must be contiguous, in order)")
    if s.raw_length > limits.max_raw_bytes:
        raise _Bad(f"{where}: raw size {s.raw_length} exceeds limit max_raw_bytes={limits.max_raw_bytes}")
    if (s.raw_length == 0) != (s.length == 0):
        raise _Bad(f"{where}: an empty section has no frame (length {s.length}, raw {s.raw_length})")
    if stored and s.raw_length == 0:
        raise _Bad(f"{where}: an empty section has no bytes to store (omit 'stored')")
    if stored and s.length != s.raw_length:
        raise _Bad(f"{where}: stored section of length {s.length} != raw_length {s.raw_length}")
    return s


def _check_version(encoding: str, kind: str, version: _Version, where: str) -> None:
    """_Bad when the payload's format version has no such encoding (prefix: 6)."""
    if encoding in _PREFIX_CODED and not version.prefix:
        raise _Bad(f"{where}: {kind} encoding {encoding!r} needs format version 6")


def _encoding_fields(obj: dict[str, Any], keys: frozenset[str], where: str) -> dict[str, Any]:
    """`_fields` of a positions / values object; one with a section may also say "stored",
    whatever its encoding: the section's parser checks its bytes either way."""
    return _fields(obj, keys, where, _STORED_ONLY if _SECTION_KEYS <= keys else frozenset())


def _parse_record(rec: Any, i: int, cursor: int, limits: DecodeLimits, version: _Version
                  ) -> tuple[_RecordMeta, int, int, int]:
    """Returns (meta, new cursor, raw bytes of its sections, decoded bytes)."""
    where = f"record #{i}"
    rec = _fields(rec, _RECORD_KEYS, where)
    name = _str(rec["name"], where, "name")
    where = f"record #{i} {name!r}"
    dname = rec["dtype"]
    if not isinstance(dname, str) or dname not in dtypes.BY_NAME:
        raise _Bad(f"{where}: unknown dtype {dname!r}")
    dt = dtypes.BY_NAME[dname]
    try:
        op = _OPS[rec["op"]]  # a dict: the Enum's own lookup took ~1 us a record
    except (KeyError, TypeError):
        raise _Bad(f"{where}: unknown op {rec['op']!r}") from None
    if not isinstance(rec["shape"], list):
        raise _Bad(f"{where}: shape must be a list")
    shape = tuple(_int(s, where, "shape") for s in rec["shape"])
    numel = _numel(shape)
    if numel is None:
        raise _Bad(f"{where}: shape {list(shape)} has a dim or more than 2**63 elements")
    count = _int(rec["count"], where, "count")
    if count > numel:
        raise _Bad(f"{where}: count {count} > numel {numel}")

    pobj = rec["positions"]
    penc = pobj.get("encoding") if isinstance(pobj, dict) else None
    if not isinstance(penc, str) or penc not in _POSITION_KEYS:  # (a list would not even hash)
        raise _Bad(f"{where}: unknown position encoding {penc!r}")
    _check_version(penc, "position", version, where)
    pobj = _encoding_fields(pobj, _POSITION_KEYS[penc], f"{where} positions")
    psec = None
    raw = 0
    m = count  # values carried in the values section
    decoded = 8 * count  # the positions array the decoder returns
    if penc == "all":
        if count != numel:
            raise _Bad(f"{where}: position encoding 'all' needs count == numel, got {count} != {numel}")
    elif penc == "dense":
        if op is Op.OVERWRITE:
            raise _Bad(f"{where}: position encoding 'dense' needs op xor or add, not overwrite")
        if not 0 < count <= numel:
            raise _Bad(f"{where}: position encoding 'dense' needs 0 < count <= numel, got {count} of {numel}")
        m = numel
    else:
        psec = _section(pobj, f"{where} positions", cursor, limits)
        cursor += psec.length
        raw += psec.raw_length
        if penc == "runs":
            # Each run is 2 varints of 1..10 bytes, and there are 1..count runs.
            lo, hi = (2, 20 * count) if count else (0, 0)
        else:  # gaps_rans / _joint / _prefix: at least shift, alphabet, one frequency or length, a
            # word or byte count; ~32 bytes a gap
            lo, hi = (4, 32 * count + 4096) if count else (1, 0)
            decoded += 4 * count
        if not lo <= psec.raw_length <= hi:
            raise _Bad(f"{where}: positions raw size {psec.raw_length} impossible for count {count}")
    decoded += m * dt.itemsize

    vobj = rec["values"]
    venc = vobj.get("encoding") if isinstance(vobj, dict) else None
    if not isinstance(venc, str) or venc not in _VALUE_KEYS:
        raise _Bad(f"{where}: unknown value encoding {venc!r}")
    _check_version(venc, "value", version, where)
    for pair in _PAIRED:
        if (penc == pair[0]) != (venc == pair[1]):
            raise _Bad(f"{where}: {pair[0]!r} positions and {pair[1]!r} values come together "
                       f"(got {penc!r} / {venc!r})")
    vobj = _encoding_fields(vobj, _VALUE_KEYS[venc], f"{where} values")
    width = _int(vobj["width"], where, "values width")
    if width != dt.itemsize:
        raise _Bad(f"{where}: value width {width} != {dt.name} itemsize {dt.itemsize}")
    vsec = _section(vobj, f"{where} values", cursor, limits)
    cursor += vsec.length
    raw += vsec.raw_length
    if venc == "planes":
        if vsec.raw_length != m * width:
            raise _Bad(f"{where}: values section holds {vsec.raw_length} bytes, "
                       f"{m} values x width {width} needs {m * width} (values count != positions count)")
    else:  # symbols_rans / _joint / _prefix (the same bounds: the other two are smaller)
        if m == 0 or not 4 <= vsec.raw_length <= (width + 24) * m + 16 * VALUE_ALPHABET:
            raise _Bad(f"{where}: values raw size {vsec.raw_length} impossible for {m} symbols")
        decoded += 4 * m
    if decoded > limits.max_raw_bytes:
        raise _Bad(f"{where}: {count} decoded positions and {m} values ({decoded} bytes) exceed limit "
                   f"max_raw_bytes={limits.max_raw_bytes}")
    meta = _RecordMeta(name, dt, shape, numel, op, count, penc, psec, vsec, venc)
    return meta, cursor, raw, raw + decoded


# ---------------------------------------------------------------- semantic checks


def _check_expected(h: PayloadHeader, exp: Expected | None) -> None:
    if exp is None:
        return
    if exp.transfer_id is not None and h.transfer_id != exp.transfer_id:
        raise _Bad(f"transfer id mismatch: payload {h.transfer_id!r}, expected {exp.transfer_id!r}")
    if exp.base_version is not None and h.base_version != exp.base_version:
        raise _Bad(f"stale version: base_version {h.base_version}, expected {exp.base_version}")
    if exp.target_version is not None and h.target_version != exp.target_version:
        raise _Bad(f"stale version: target_version {h.target_version}, expected {exp.target_version}")


def _check_catalog(metas: list[_RecordMeta],
                   catalog: Mapping[str, tuple[str, tuple[int, ...]]] | None) -> None:
    if catalog is None:
        return
    for m in metas:
        entry = catalog.get(m.name)
        if entry is None:
            raise _Bad(f"unknown tensor name {m.name!r} (not in the receiver's catalog)")
        cdtype, cshape = entry
        if m.dtype.name != cdtype:
            raise _Bad(f"{m.name!r}: dtype mismatch: payload {m.dtype.name}, catalog {cdtype}")
        if m.shape != tuple(int(s) for s in cshape):
            raise _Bad(f"{m.name!r}: shape mismatch: payload {list(m.shape)}, catalog {list(cshape)}")


def _check_no_overlap(records: list[Record]) -> None:
    by_name: dict[str, list[Record]] = {}
    for r in records:
        by_name.setdefault(r.name, []).append(r)
    for name, recs in by_name.items():
        if len(recs) < 2:
            continue
        if any(r.dtype != recs[0].dtype or r.shape != recs[0].shape for r in recs):
            raise _Bad(f"duplicate record {name!r} with different dtype/shape")
        if _overlap([r.positions for r in recs]):
            raise _Bad(f"duplicate record {name!r} with overlapping positions")


def _overlap(arrays: list) -> bool:
    """Whether position arrays (or tensors, on any device) share a position."""
    allp = np.sort(np.concatenate([a.cpu().numpy() if isinstance(a, torch.Tensor) else a for a in arrays]))
    return bool(allp.size > 1 and np.any(allp[1:] == allp[:-1]))


# ---------------------------------------------------------------- sections


def _section_bytes(body: memoryview, sec: _Section, where: str,
                   dctx: zstandard.ZstdDecompressor) -> bytes | memoryview:
    """The section's exactly sec.raw_length raw bytes, or _Bad. A zstd frame's own claims are not trusted."""
    if sec.raw_length == 0:
        return b""
    frame = body[sec.offset:sec.offset + sec.length]
    if sec.stored:  # read in place; the header parser checked length == raw_length
        return frame
    if bytes(frame[:4]) != _ZSTD_FRAME_MAGIC:
        raise _Bad(f"{where}: section is not a zstd frame")
    try:
        declared = zstandard.get_frame_parameters(frame).content_size
    except zstandard.ZstdError as e:
        raise _Bad(f"{where}: bad zstd frame header ({e})") from None
    if declared != sec.raw_length:
        # Checked before decompressing: the output buffer is sized from the frame.
        raise _Bad(f"{where}: zstd frame declares {declared} bytes, header says {sec.raw_length} "
                   "(possible decompression bomb)")
    try:
        out = dctx.decompress(frame, max_output_size=sec.raw_length, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise _Bad(f"{where}: zstd decompression failed ({e})") from None
    if len(out) != sec.raw_length:
        raise _Bad(f"{where}: decompressed to {len(out)} bytes, header says {sec.raw_length}")
    return out


def _decode_record(m: _RecordMeta, body: memoryview, dctx: zstandard.ZstdDecompressor) -> Record:
    where = f"record {m.name!r}"
    nvals = m.numel if m.positions_encoding == "dense" else m.count
    pos = gaps = None
    if m.positions_encoding not in ("all", "dense"):
        assert m.positions is not None
        raw = _section_bytes(body, m.positions, f"{where} positions", dctx)
        with _AsBad(f"{where} positions"):
            if m.positions_encoding == "runs":
                pos = decode_runs(raw, m.count, m.numel)
            elif m.positions_encoding == "gaps_prefix":
                gaps = prefix.PrefixGaps(raw, m.count)
            else:  # gaps_rans / gaps_joint (the header parser admits no other encoding with a section)
                gaps = GapsReader(raw, m.count, joint=m.positions_encoding == "gaps_joint")
    if m.positions_encoding == "gaps_joint":
        return _decode_joint(m, body, dctx, where, gaps)
    if m.positions_encoding == "gaps_prefix":
        return _decode_prefix(m, body, dctx, where, gaps)
    values = _paired_values(m, body, dctx, where, gaps)
    if values is not None:
        # Both rANS streams in one pass; each stream's errors are raised where the single
        # decodes would raise them (positions first).
        psym, pstatus, vsym, vstatus = decode_rans_pair(gaps.stream, values.stream, m.count)
        with _AsBad(f"{where} positions"):
            gaps.stream.check(pstatus)
            pos = gaps.positions(psym, m.numel)
        with _AsBad(f"{where} values"):
            values.stream.check(vstatus)
            vals = values.values(vsym)
    elif gaps is not None:
        with _AsBad(f"{where} positions"):
            pos = gaps.positions(gaps.stream.decode(m.count), m.numel)
    if values is None:
        vals = _decode_values(m, body, dctx, where, nvals)
    if m.positions_encoding == "dense":
        nz = np.flatnonzero(vals)
        if nz.size != m.count:
            raise _Bad(f"{where}: dense values hold {nz.size} changes, header declares count {m.count}")
        pos, vals = nz.astype(np.uint64), vals[nz]
    elif pos is None:
        pos = np.arange(m.count, dtype=np.uint64)
    if not vals.flags.writeable:
        vals = vals.copy()
    return Record(m.name, m.dtype.name, m.shape, m.op, pos, vals)


def _decode_joint(m: _RecordMeta, body: memoryview, dctx: zstandard.ZstdDecompressor, where: str,
                  gaps: GapsReader) -> Record:
    """A `gaps_joint` / `symbols_joint` record: both sections read up to their models, then
    the joint stream (in the positions section; its errors are the positions')."""
    with _AsBad(f"{where} values"):
        values = _ValuesReader(_section_bytes(body, m.values, f"{where} values", dctx), m.count, m.dtype, where,
                               coding="joint")
        direct = values.direct_table()  # the decoder then writes the values, not their symbols
    with _AsBad(f"{where} positions"):
        pos, second = decode_joint_gaps(gaps, values.model, m.numel, direct)
    with _AsBad(f"{where} values"):
        vals = second if direct is not None else values.values(second)
    return Record(m.name, m.dtype.name, m.shape, m.op, pos, vals)


def _decode_prefix(m: _RecordMeta, body: memoryview, dctx: zstandard.ZstdDecompressor, where: str,
                   gaps: prefix.PrefixGaps) -> Record:
    """A `gaps_prefix` / `symbols_prefix` record: both sections read up to their codes, then
    the bit stream (in the positions section; its errors are the positions')."""
    with _AsBad(f"{where} values"):
        values = _ValuesReader(_section_bytes(body, m.values, f"{where} values", dctx), m.count, m.dtype, where,
                               coding="prefix")
    with _AsBad(f"{where} positions"):
        qsym, gaps_, vsym = gaps.split(values.model)
        pos = gaps.positions(qsym, gaps_, m.numel)
    with _AsBad(f"{where} values"):
        vals = values.values(vsym)
    return Record(m.name, m.dtype.name, m.shape, m.op, pos, vals)


class _AsBad:
    """Context: a PositionsError inside becomes _Bad(f"{where}: {reason}")."""

    def __init__(self, where: str):
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: Any, e: BaseException | None, tb: Any) -> None:
        if isinstance(e, PositionsError):
            raise _Bad(f"{self.where}: {e}") from None


def _paired_values(m: _RecordMeta, body: memoryview, dctx: zstandard.ZstdDecompressor, where: str,
                   gaps: GapsReader | None) -> _ValuesReader | None:
    """The values section read up to its symbols when the record's two rANS streams can be
    decoded in one pass (gaps_rans + symbols_rans, both with words, at least _PAIR_MIN
    changes), else None. A values section that fails here is left to `_decode_values`,
    after the positions, so that errors come in the same order either way."""
    if gaps is None or m.values_encoding != "symbols_rans" or m.count < _PAIR_MIN or gaps.stream.words is None:
        return None
    try:
        values = _ValuesReader(_section_bytes(body, m.values, f"{where} values", dctx), m.count, m.dtype, where)
    except (_Bad, PositionsError):
        return None
    return values if values.stream.words is not None else None


def _decode_values(m: _RecordMeta, body: memoryview, dctx: zstandard.ZstdDecompressor, where: str,
                   nvals: int) -> np.ndarray:
    vraw = _section_bytes(body, m.values, f"{where} values", dctx)
    if m.values_encoding == "symbols_rans":
        with _AsBad(f"{where} values"):
            return decode_value_symbols(vraw, nvals, m.dtype, where)
    planes = np.frombuffer(vraw, dtype=np.uint8).reshape(m.dtype.itemsize, nvals)
    # np.array copies: the caller gets writable arrays that own their memory.
    return np.array(planes.T, order="C").view(m.dtype.bits_numpy).reshape(nvals)
