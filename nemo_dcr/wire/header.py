"""The payload's JSON header (docs/wire-format.md, "Header"): its schema, parsed and checked
field by field (`parse_header`) into the payload's identity and one `RecordMeta` a record,
before any section is read; the limits it is checked against; and the receiver's checks of
what a payload must belong to (`check_expected`, `check_catalog`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from .. import dtypes
from ..records import Op, PayloadHeader
from .errors import Malformed
from .positions import MAX_NUMEL
from .values import VALUE_ALPHABET
from .versions import DEVICE_FORMAT


POSITION_ENCODINGS = ("gaps_rans", "gaps_joint", "gaps_prefix", "gaps_conditioned", "runs", "all", "dense")
VALUE_ENCODINGS = ("symbols_rans", "symbols_joint", "symbols_prefix", "symbols_conditioned", "planes")
# v5: a record's positions and values as one rANS stream (nemo_dcr.wire.joint); always together.
JOINT = ("gaps_joint", "symbols_joint")
# v6: the same as one prefix-coded bit stream, coded where the record's tensors are
# (nemo_dcr.wire.prefix); always together.
PREFIX_CODED = ("gaps_prefix", "symbols_prefix")
# Coded against the old bits of the record's universe, which the record's "baseline" names
# (nemo_dcr.wire.conditioned); always together, and only with a baseline.
CONDITIONED = ("gaps_conditioned", "symbols_conditioned")
# The pairs of encodings that only come together, positions first.
PAIRED = (JOINT, PREFIX_CODED, CONDITIONED)


_GiB = 1 << 30


_TOP_KEYS = frozenset(
    {"base_version", "body_bytes", "payload_id", "producer_id", "raw_bytes", "records",
     "target_version", "transfer_id"}
)
_RECORD_KEYS = frozenset({"count", "dtype", "name", "op", "positions", "shape", "values"})
BASELINE = "baseline"  # a conditioned record's universe and the digest of its old bits
_BASELINE_KEYS = frozenset({"lo", "n", "xxh3"})
_OPS = {op.value: op for op in Op}
_SECTION_KEYS = frozenset({"offset", "length", "raw_length"})
# A section may say "stored": true (raw bytes, no zstd frame); omitted otherwise, so that
# each section has one spelling. Only `true` is valid.
STORED = "stored"
STORED_ONLY = frozenset({STORED})
_POSITION_KEYS = {"runs": _SECTION_KEYS | {"encoding"}, "gaps_rans": _SECTION_KEYS | {"encoding"},
                  "gaps_joint": _SECTION_KEYS | {"encoding"}, "gaps_prefix": _SECTION_KEYS | {"encoding"},
                  "gaps_conditioned": _SECTION_KEYS | {"encoding"},
                  "all": frozenset({"encoding"}), "dense": frozenset({"encoding"})}
_VALUE_KEYS = {"planes": _SECTION_KEYS | {"encoding", "width"},
               "symbols_rans": _SECTION_KEYS | {"encoding", "width"},
               "symbols_joint": _SECTION_KEYS | {"encoding", "width"},
               "symbols_prefix": _SECTION_KEYS | {"encoding", "width"},
               "symbols_conditioned": _SECTION_KEYS | {"encoding", "width"}}


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
class Section:
    offset: int
    length: int
    raw_length: int
    stored: bool = False  # raw bytes in the body, else one zstd frame


@dataclass(frozen=True)
class RecordMeta:
    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    numel: int
    op: Op
    count: int
    positions_encoding: str
    positions: Section | None
    values: Section
    values_encoding: str = "planes"
    baseline: Baseline | None = None  # conditioned records only


@dataclass(frozen=True)
class Baseline:
    """A conditioned record's universe (canonical positions lo .. lo + n of its tensor) and
    the digest of the old bits there (nemo_dcr.wire.conditioned.baseline_digest)."""

    lo: int
    n: int
    xxh3: str


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise Malformed("malformed header JSON: duplicate key")
    return d


def _reject_constant(name: str) -> Any:
    raise Malformed(f"malformed header JSON: non-standard constant {name}")


def _fields(obj: Any, keys: frozenset[str], where: str, optional: frozenset[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise Malformed(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if obj.keys() == keys:  # exactly the fields, as a payload has them: no set arithmetic
        return obj
    missing = keys - obj.keys()
    extra = obj.keys() - keys - optional
    if missing:
        raise Malformed(f"{where}: missing field(s) {sorted(missing)}")
    if extra:
        raise Malformed(f"{where}: unknown field(s) {sorted(extra)}")
    return obj


# The checks below take the field's name apart from where it is (`what`) and join them only
# for an error: a header's ~20 messages a record, built up front, were a visible share of a
# small record's decode.


def _at(where: str, what: str) -> str:
    return f"{where} {what}" if what else where


def _int(v: Any, where: str, what: str = "") -> int:
    if type(v) is not int:
        raise Malformed(f"{_at(where, what)}: expected an integer, got {type(v).__name__}")
    if v < 0:
        raise Malformed(f"{_at(where, what)}: negative value {v}")
    return v


def _str(v: Any, where: str, what: str = "") -> str:
    if not isinstance(v, str) or not v:
        raise Malformed(f"{_at(where, what)}: expected a non-empty string, got {type(v).__name__}")
    return v


def numel_of(shape: tuple[int, ...]) -> int | None:
    n = 1
    for s in shape:
        if s < 0 or s > MAX_NUMEL:
            return None
        n *= s
        if n > MAX_NUMEL:
            return None
    return n


def check_identity(h: PayloadHeader, exc: type[Exception]) -> None:
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


def parse_header(hbytes: bytes, body_len: int, limits: DecodeLimits, version: int
                 ) -> tuple[PayloadHeader, list[RecordMeta]]:
    """The payload's identity and its records' metadata from the header's bytes, every
    field checked (`version`: the frame head's format version); Malformed otherwise."""
    try:
        text = hbytes.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Malformed(f"malformed header: not UTF-8 ({e.reason})") from None
    try:
        raw = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise Malformed(f"malformed header JSON: {e}") from None
    top = _fields(raw, _TOP_KEYS, "header")
    header = PayloadHeader(
        transfer_id=_str(top["transfer_id"], "header transfer_id"),
        base_version=_int(top["base_version"], "header base_version"),
        target_version=_int(top["target_version"], "header target_version"),
        producer_id=_str(top["producer_id"], "header producer_id"),
        payload_id=_str(top["payload_id"], "header payload_id"),
    )
    check_identity(header, Malformed)
    if _int(top["body_bytes"], "header body_bytes") != body_len:
        raise Malformed(f"declared body_bytes {top['body_bytes']} != actual body {body_len}")
    declared_raw = _int(top["raw_bytes"], "header raw_bytes")
    recs = top["records"]
    if not isinstance(recs, list):
        raise Malformed("header records: expected a list")
    if len(recs) > limits.max_records:
        raise Malformed(f"{len(recs)} records exceed limit max_records={limits.max_records}")
    metas: list[RecordMeta] = []
    cursor = raw_sum = decoded = 0
    for i, rec in enumerate(recs):
        m, cursor, raw, dec = _parse_record(rec, i, cursor, limits, version)
        metas.append(m)
        raw_sum += raw
        decoded += dec
    if cursor != body_len:
        raise Malformed(f"sections cover {cursor} bytes but the body has {body_len}")
    if raw_sum != declared_raw:
        raise Malformed(f"declared raw_bytes {declared_raw} != sum of section raw lengths {raw_sum}")
    if decoded > limits.max_total_raw_bytes:
        raise Malformed(f"decoded size {decoded} exceeds limit max_total_raw_bytes={limits.max_total_raw_bytes}")
    if header.target_version == header.base_version and any(m.op is not Op.OVERWRITE for m in metas):
        # A payload that keeps its version is an anchor (nemo_dcr.history): it states bits, never changes them.
        raise Malformed(f"header: base_version == target_version {header.base_version} (an anchor) "
                        "but a record is not an overwrite")
    return header, metas


def _section(obj: dict[str, Any], where: str, cursor: int, limits: DecodeLimits) -> Section:
    """The section an object names; its field set was checked by `_fields`."""
    stored = STORED in obj
    if stored and obj[STORED] is not True:
        raise Malformed(f"{where} stored: expected true (a zstd section omits the field), got {obj[STORED]!r}")
    s = Section(_int(obj["offset"], where, "offset"), _int(obj["length"], where, "length"),
                _int(obj["raw_length"], where, "raw_length"), stored)
    if s.offset != cursor:
        raise Malformed(f"{where}: offset {s.offset} != expected {cursor} (sections must be contiguous, in order)")
    if s.raw_length > limits.max_raw_bytes:
        raise Malformed(f"{where}: raw size {s.raw_length} exceeds limit max_raw_bytes={limits.max_raw_bytes}")
    if (s.raw_length == 0) != (s.length == 0):
        raise Malformed(f"{where}: an empty section has no frame (length {s.length}, raw {s.raw_length})")
    if stored and s.raw_length == 0:
        raise Malformed(f"{where}: an empty section has no bytes to store (omit 'stored')")
    if stored and s.length != s.raw_length:
        raise Malformed(f"{where}: stored section of length {s.length} != raw_length {s.raw_length}")
    return s


def _check_version(encoding: str, kind: str, version: int, where: str) -> None:
    """Malformed when the payload's format version has no such encoding (prefix: 6)."""
    if encoding in PREFIX_CODED and version != DEVICE_FORMAT:
        raise Malformed(f"{where}: {kind} encoding {encoding!r} needs format version 6")


def _encoding_fields(obj: dict[str, Any], keys: frozenset[str], where: str) -> dict[str, Any]:
    """`_fields` of a positions / values object; one with a section may also say "stored",
    whatever its encoding: the section's parser checks its bytes either way."""
    return _fields(obj, keys, where, STORED_ONLY if _SECTION_KEYS <= keys else frozenset())


def _parse_record(rec: Any, i: int, cursor: int, limits: DecodeLimits, version: int
                  ) -> tuple[RecordMeta, int, int, int]:
    """Returns (meta, new cursor, raw bytes of its sections, decoded bytes)."""
    where = f"record #{i}"
    rec = _fields(rec, _RECORD_KEYS, where, frozenset({BASELINE}))
    name = _str(rec["name"], where, "name")
    where = f"record #{i} {name!r}"
    dname = rec["dtype"]
    if not isinstance(dname, str) or dname not in dtypes.BY_NAME:
        raise Malformed(f"{where}: unknown dtype {dname!r}")
    dt = dtypes.BY_NAME[dname]
    try:
        op = _OPS[rec["op"]]  # a dict: cheaper than the Enum's own lookup
    except (KeyError, TypeError):
        raise Malformed(f"{where}: unknown op {rec['op']!r}") from None
    if not isinstance(rec["shape"], list):
        raise Malformed(f"{where}: shape must be a list")
    shape = tuple(_int(s, where, "shape") for s in rec["shape"])
    numel = numel_of(shape)
    if numel is None:
        raise Malformed(f"{where}: shape {list(shape)} has a dim or more than 2**63 elements")
    count = _int(rec["count"], where, "count")
    if count > numel:
        raise Malformed(f"{where}: count {count} > numel {numel}")

    pobj = rec["positions"]
    penc = pobj.get("encoding") if isinstance(pobj, dict) else None
    if not isinstance(penc, str) or penc not in _POSITION_KEYS:  # (a list would not even hash)
        raise Malformed(f"{where}: unknown position encoding {penc!r}")
    _check_version(penc, "position", version, where)
    pobj = _encoding_fields(pobj, _POSITION_KEYS[penc], f"{where} positions")
    psec = None
    raw = 0
    m = count  # values carried in the values section
    decoded = 8 * count  # the positions array the decoder returns
    if penc == "all":
        if count != numel:
            raise Malformed(f"{where}: position encoding 'all' needs count == numel, got {count} != {numel}")
    elif penc == "dense":
        if op is Op.OVERWRITE:
            raise Malformed(f"{where}: position encoding 'dense' needs op xor or add, not overwrite")
        if not 0 < count <= numel:
            raise Malformed(f"{where}: position encoding 'dense' needs 0 < count <= numel, got {count} of {numel}")
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
            raise Malformed(f"{where}: positions raw size {psec.raw_length} impossible for count {count}")
    decoded += m * dt.itemsize

    vobj = rec["values"]
    venc = vobj.get("encoding") if isinstance(vobj, dict) else None
    if not isinstance(venc, str) or venc not in _VALUE_KEYS:
        raise Malformed(f"{where}: unknown value encoding {venc!r}")
    _check_version(venc, "value", version, where)
    for pair in PAIRED:
        if (penc == pair[0]) != (venc == pair[1]):
            raise Malformed(f"{where}: {pair[0]!r} positions and {pair[1]!r} values come together "
                            f"(got {penc!r} / {venc!r})")
    vobj = _encoding_fields(vobj, _VALUE_KEYS[venc], f"{where} values")
    width = _int(vobj["width"], where, "values width")
    if width != dt.itemsize:
        raise Malformed(f"{where}: value width {width} != {dt.name} itemsize {dt.itemsize}")
    vsec = _section(vobj, f"{where} values", cursor, limits)
    cursor += vsec.length
    raw += vsec.raw_length
    if venc == "planes":
        if vsec.raw_length != m * width:
            raise Malformed(f"{where}: values section holds {vsec.raw_length} bytes, "
                            f"{m} values x width {width} needs {m * width} (values count != positions count)")
    else:  # symbols_rans / _joint / _prefix (the same bounds: the other two are smaller)
        if m == 0 or not 4 <= vsec.raw_length <= (width + 24) * m + 16 * VALUE_ALPHABET:
            raise Malformed(f"{where}: values raw size {vsec.raw_length} impossible for {m} symbols")
        decoded += 4 * m
    if decoded > limits.max_raw_bytes:
        raise Malformed(f"{where}: {count} decoded positions and {m} values ({decoded} bytes) exceed limit "
                        f"max_raw_bytes={limits.max_raw_bytes}")
    baseline = None
    if (BASELINE in rec) != (penc == CONDITIONED[0]):
        raise Malformed(f"{where}: a {BASELINE!r} comes with conditioned records, and only with them")
    if penc == CONDITIONED[0]:
        baseline = _baseline(rec[BASELINE], where, numel, count)
        if dt.itemsize != 2 or op is Op.OVERWRITE:
            raise Malformed(f"{where}: conditioned records are 2-byte xor or add records, got {dt.name} {op.value}")
    meta = RecordMeta(name, dt, shape, numel, op, count, penc, psec, vsec, venc, baseline)
    return meta, cursor, raw, raw + decoded


def _baseline(obj: Any, where: str, numel: int, count: int) -> Baseline:
    where = f"{where} {BASELINE}"
    obj = _fields(obj, _BASELINE_KEYS, where)
    lo, n, xxh3 = _int(obj["lo"], where, "lo"), _int(obj["n"], where, "n"), _str(obj["xxh3"], where, "xxh3")
    if lo + n > numel or n < count:
        raise Malformed(f"{where}: universe [{lo}, {lo + n}) must lie in the tensor's {numel} elements "
                        f"and hold its {count} changes")
    if len(xxh3) != 16 or any(ch not in "0123456789abcdef" for ch in xxh3):
        raise Malformed(f"{where}: xxh3 must be 16 lowercase hex digits, got {xxh3!r}")
    return Baseline(lo, n, xxh3)


def check_expected(h: PayloadHeader, exp: Expected | None) -> None:
    if exp is None:
        return
    if exp.transfer_id is not None and h.transfer_id != exp.transfer_id:
        raise Malformed(f"transfer id mismatch: payload {h.transfer_id!r}, expected {exp.transfer_id!r}")
    if exp.base_version is not None and h.base_version != exp.base_version:
        raise Malformed(f"stale version: base_version {h.base_version}, expected {exp.base_version}")
    if exp.target_version is not None and h.target_version != exp.target_version:
        raise Malformed(f"stale version: target_version {h.target_version}, expected {exp.target_version}")


def check_catalog(metas: list[RecordMeta],
                  catalog: Mapping[str, tuple[str, tuple[int, ...]]] | None) -> None:
    if catalog is None:
        return
    for m in metas:
        entry = catalog.get(m.name)
        if entry is None:
            raise Malformed(f"unknown tensor name {m.name!r} (not in the receiver's catalog)")
        cdtype, cshape = entry
        if m.dtype.name != cdtype:
            raise Malformed(f"{m.name!r}: dtype mismatch: payload {m.dtype.name}, catalog {cdtype}")
        if m.shape != tuple(int(s) for s in cshape):
            raise Malformed(f"{m.name!r}: shape mismatch: payload {list(m.shape)}, catalog {list(cshape)}")
