"""Wire codec, formats v5 (host) and v6 (device): `Payload` <-> bytes. The spec is
docs/wire-format.md; the format's parts are the other modules of nemo_dcr.wire.

`encode` picks, per record, whichever encodings are smallest on the wire, and lays out
their sections (`frame`): positions `gaps_rans` (`gaps`: Rice-split gaps, quotients in a
rANS stream), `runs` (`positions`), `all`, `dense` (xor/add values at every element, zeros
dropped on decode); values `symbols_rans` (`values`: a rANS-coded table of distinct values
plus escapes) or `planes` (byte planes); `gaps_joint` + `symbols_joint` (`joint`: the
quotients and value symbols in one rANS stream, one symbol per change), and, in v6,
`gaps_prefix` + `symbols_prefix` (`prefix`: one bit stream of prefix codes, coded with
torch ops on the device that holds the record's tensors). The decoded `Record` does not
depend on that choice.

`decode` validates everything - framing, checksum, HMAC, header schema, sizes, limits,
every position and value - before it returns, so a receiver can reject a payload before
it writes a byte. Every failure is a `PayloadRejected` naming the payload and the reason.
Nothing is unpickled.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Collection, Mapping

import numpy as np
import torch
import zstandard

from .. import dtypes
from ..errors import PayloadRejected
from ..records import BaseSpan, Op, Payload, PayloadHeader, Record
from . import conditioned, prefix
from .errors import Malformed, PositionsError
from .frame import FRAME_HEAD_BYTES, MAX_WINDOW, bytes_view, check_trailer, header_json, key_bytes, \
    parse_frame_head, seal, seal_on_device, section_bytes, sniff
from .gaps import GapsParts, GapsReader, encode_gaps_rans, gaps_parts
from .header import BASELINE, CONDITIONED, JOINT, PREFIX_CODED, STORED, DecodeLimits, Expected, RecordMeta, \
    check_catalog, check_expected, check_identity, numel_of, parse_header
from .joint import decode_joint_gaps, encode_joint
from .positions import check_positions, decode_runs, encode_runs
from .rans import chunks_size, decode_rans_pair, encode_rans_chunks, encode_rans_pair
from .values import ValuesReader, decode_planes, decode_value_symbols, encode_planes, encode_value_symbols, \
    value_parts, value_table
from .versions import DEVICE_FORMAT, FORMAT_VERSION, WRITABLE_VERSIONS, writable_versions_text


# Records of at most this many changes also try the simple v1 encodings (runs, planes).
_SMALL = 64


# What the encoder stores raw: rANS output is incompressible, zstd would only cost time.
_STORED_ENCODINGS = frozenset({"gaps_rans", "symbols_rans", *JOINT, *PREFIX_CODED, *CONDITIONED})


class _Rejecting:
    """Context: any failure inside becomes PayloadRejected(pid, reason)."""

    def __init__(self) -> None:
        self.pid: str | None = None  # set as soon as the header names the payload

    def __enter__(self) -> _Rejecting:
        return self

    def __exit__(self, et: Any, e: BaseException | None, tb: Any) -> None:
        if e is None or isinstance(e, PayloadRejected) or not isinstance(e, Exception):
            return  # propagate unchanged (None: never swallow)
        if isinstance(e, (Malformed, PositionsError)):
            raise PayloadRejected(self.pid, str(e)) from None
        # Safety net: malformed input must never escape as another exception type.
        raise PayloadRejected(self.pid, f"malformed payload ({type(e).__name__}: {e})") from e


def encode(payload: Payload, *, key: bytes | None = None, level: int = 1, dense: str = "auto",
           version: int = FORMAT_VERSION, on_device: torch.device | str | None = None) -> bytes | torch.Tensor:
    """Serialize `payload` (format v5, or `version` 6). Raises ValueError on an invalid payload.

    key: HMAC-SHA256 key; when given the payload is signed (flag bit 0).
    level: zstd compression level for every section that is not stored raw.
    dense: "auto" sends an xor/add record densely (every element's value, zeros
           included) when that is smaller on the wire; "never" / "always" force it
           (for benchmarks). The decoded record is the same either way.
    version: 5, the host format, or 6, the device format (experimental): records whose
           positions and values are torch tensors are then coded where they are, with
           prefix codes (`gaps_prefix` / `symbols_prefix`, nemo_dcr.wire.prefix: a GPU codes
           them itself); the rest as version 5 codes them. With 5, tensors are copied to
           the host and coded there.
    on_device: (version 6, no key) the payload is returned as a 1-D uint8 tensor on this
           device, sealed there with the device checksum (flag bit 2): the device-coded
           sections never reach the host (the local transport hands such a payload to
           receivers by CUDA IPC). The same bytes as the host's frame but for the flag and
           the trailer.
    """
    if dense not in ("auto", "never", "always"):
        raise ValueError(f"dense must be 'auto', 'never' or 'always', got {dense!r}")
    if version not in WRITABLE_VERSIONS:
        raise ValueError(f"version must be {writable_versions_text()} (the versions this encoder writes), "
                         f"got {version!r}")
    if on_device is not None and (version != DEVICE_FORMAT or key is not None):
        raise ValueError(f"on_device needs version {DEVICE_FORMAT} and no key (the device checksum stands for "
                         f"XXH3, and an HMAC needs the bytes on the host), got version {version}"
                         f"{' and a key' if key is not None else ''}")
    h = payload.header
    check_identity(h, ValueError)
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
            sec[STORED] = True
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
        numel = numel_of(shape)
        if numel is None:
            raise ValueError(f"{where}: shape {shape} has a negative dim or > 2**63 elements")
        coded, base = None, r.base
        if isinstance(r.positions, torch.Tensor) or isinstance(r.values, torch.Tensor):
            r, coded = _tensor_record(r, dt, numel, where, version == DEVICE_FORMAT, cctx)
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
        baseline = None
        if base is not None and dense != "always":
            cond = _conditioned(pos, vals, dt, op, numel, base, where, pchoice.size + vchoice.size)
            if cond is not None:
                pchoice, vchoice, baseline = cond
        pmeta = {"encoding": pchoice.encoding, **place(pchoice if pchoice.frame is not None else None)}
        vmeta = {"encoding": vchoice.encoding, "width": dt.itemsize, **place(vchoice)}
        metas.append({"name": r.name, "dtype": dt.name, "shape": list(shape), "op": op.value,
                      "count": count, "positions": pmeta, "values": vmeta})
        if baseline is not None:
            metas[-1][BASELINE] = baseline
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
    if on_device is not None:
        return seal_on_device(version, hbytes, sections, torch.device(on_device))
    return seal(version, hbytes, sections, key)


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
# in one pass (rans.encode_rans_pair); the bytes are the same either way.
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
        # (nemo_dcr.wire.joint) when neither runs nor planes could be smaller, else their two
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


# Conditioned coding is tried for records of at least this many changes (below it, its
# tables and the baseline's header field cost more than the conditioning saves).
_CONDITIONED_MIN = 256
_BASELINE_FIELD_BYTES = 64  # what a record's "baseline" adds to the header, about


def _conditioned(pos: np.ndarray, vals: np.ndarray, dt: dtypes.DType, op: Op, numel: int, base: BaseSpan,
                 where: str, plain_size: int) -> tuple[_Choice, _Choice, dict[str, Any]] | None:
    """The record coded against `base` (nemo_dcr.wire.conditioned), with its header field,
    when that is smaller on the wire than `plain_size` bytes; else None."""
    count = int(pos.size)
    if not (conditioned.eligible(dt, op) and _CONDITIONED_MIN <= count < numel):
        return None
    bits = np.asarray(base.bits)
    if bits.ndim != 1 or bits.dtype.itemsize != dt.itemsize or not 0 <= base.lo <= base.hi <= numel:
        raise ValueError(f"{where}: base must be a 1-D array of {dt.itemsize}-byte bits within the tensor's "
                         f"{numel} elements, got {bits.dtype} shape {bits.shape} at {base.lo}")
    if count > bits.size or int(pos[0]) < base.lo or int(pos[-1]) >= base.hi:
        return None  # not every change lies in the span: coded as usual
    psec, vsec = conditioned.encode_conditioned(pos, vals, dt, op, BaseSpan(base.lo, bits))
    if len(psec) + len(vsec) + _BASELINE_FIELD_BYTES >= plain_size:
        return None
    field = {"lo": int(base.lo), "n": int(bits.size), "xxh3": conditioned.baseline_digest(bits)}
    return (_Choice(CONDITIONED[0], [psec], len(psec), stored=True, size=len(psec)),
            _Choice(CONDITIONED[1], [vsec], len(vsec), stored=True, size=len(vsec)), field)


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
        alt = _frame("planes", encode_planes(vals, dt.itemsize), cctx)
        if best is None or alt.size <= best.size:
            best = alt
    return best


# Integer views of a tensor's value bits by width, for the prefix coder (nemo_dcr.wire.prefix).
_TORCH_BITS = {1: torch.uint8, 2: torch.int16}


def _tensor_record(r: Record, dt: dtypes.DType, numel: int, where: str, prefix_ok: bool,
                   cctx: zstandard.ZstdCompressor) -> tuple[Record, tuple[_Choice, _Choice] | None]:
    """A record whose positions and values are torch tensors (on any one device): coded
    where they are, as `gaps_prefix` + `symbols_prefix` (nemo_dcr.wire.prefix), when the
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


def decode(
    data: bytes | memoryview,
    *,
    key: bytes | None = None,
    catalog: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
    expected: Expected | None = None,
    limits: DecodeLimits = DecodeLimits(),
    baselines: conditioned.BaselineSource | None = None,
    held: Collection[str] | None = None,
    threads: int = 1,
) -> Payload:
    """Validate and decode a payload (format v5 or v6); raise PayloadRejected(payload_id, reason) if bad.

    key: when given the payload must carry a valid HMAC; a signed payload is also
         rejected when no key is given (it cannot be verified).
    catalog: canonical name -> (dtype name, shape) the receiver serves.
    expected: transfer id / versions the receiver is waiting for.
    baselines: the receiver's committed canonical bits, for records coded against them
         (nemo_dcr.wire.conditioned); without it such a record is rejected.
    held: the tensors this decoder applies (None: all). A conditioned record of another
         tensor is left out of the decoded payload: its baseline is not here to decode it.
    threads: records are decoded on up to this many threads (the compiled passes and zstd
         release the GIL). The result, and which record a rejection names (the first bad
         one in header order), do not depend on it.
    """
    if type(threads) is not int or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    kbytes = key_bytes(key) if key is not None else None
    mv = bytes_view(data)
    with _Rejecting() as guard:
        version, flags, hlen, body_len = parse_frame_head(mv, limits)
        hbytes = header_json(mv, flags, hlen, limits)
        guard.pid, declared_body = sniff(hbytes)
        if declared_body is not None and declared_body != body_len:
            want = len(mv) - body_len + declared_body
            why = "truncated" if want > len(mv) else "trailing bytes"
            raise Malformed(f"{why}: header declares a {want}-byte payload, got {len(mv)} bytes")
        check_trailer(mv, FRAME_HEAD_BYTES + hlen + body_len, flags, kbytes)
        header, metas = parse_header(hbytes, body_len, limits, version)
        guard.pid = header.payload_id
        check_expected(header, expected)
        check_catalog(metas, catalog)
        # Read-only: stored sections are read in place, and nothing here may write to the caller's buffer.
        body = mv[FRAME_HEAD_BYTES + hlen:FRAME_HEAD_BYTES + hlen + body_len].toreadonly()
        wanted = [m for m in metas if held is None or m.baseline is None or m.name in held]
        records = _decode_records(wanted, body, baselines, threads)
        _check_no_overlap(records)
        return Payload(header=header, records=records)


def header_text(data: bytes | memoryview, *, limits: DecodeLimits = DecodeLimits()) -> str:
    """The payload's header JSON as text (decompressed where it travels compressed), to
    see what the encoder chose; nothing is validated beyond the frame head."""
    mv = bytes_view(data)
    with _Rejecting():
        _, flags, hlen, _ = parse_frame_head(mv, limits)
        return header_json(mv, flags, hlen, limits).decode("utf-8", "replace")


def peek_header(data: bytes | memoryview, *, limits: DecodeLimits = DecodeLimits()) -> PayloadHeader:
    """The payload's identity, for dedup and routing, without touching the body.

    Checks magic, version, flags, lengths and the header schema; does NOT verify the
    checksum or HMAC, so the result is untrusted until `decode` accepts the payload.
    """
    mv = bytes_view(data)
    with _Rejecting() as guard:
        version, flags, hlen, body_len = parse_frame_head(mv, limits)
        hbytes = header_json(mv, flags, hlen, limits)
        guard.pid, _ = sniff(hbytes)
        header, _ = parse_header(hbytes, body_len, limits, version)
        return header


def _check_no_overlap(records: list[Record]) -> None:
    by_name: dict[str, list[Record]] = {}
    for r in records:
        by_name.setdefault(r.name, []).append(r)
    for name, recs in by_name.items():
        if len(recs) < 2:
            continue
        if any(r.dtype != recs[0].dtype or r.shape != recs[0].shape for r in recs):
            raise Malformed(f"duplicate record {name!r} with different dtype/shape")
        if _overlap([r.positions for r in recs]):
            raise Malformed(f"duplicate record {name!r} with overlapping positions")


def _overlap(arrays: list) -> bool:
    """Whether position arrays (or tensors, on any device) share a position."""
    allp = np.sort(np.concatenate([a.cpu().numpy() if isinstance(a, torch.Tensor) else a for a in arrays]))
    return bool(allp.size > 1 and np.any(allp[1:] == allp[:-1]))


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_thread_state = threading.local()


def _decode_records(metas: list[RecordMeta], body: memoryview, baselines: conditioned.BaselineSource | None,
                    threads: int) -> list[Record]:
    """The records of `metas`, in order; on `threads` threads of a shared pool where there
    are several. A failure is raised for the first failing record in order, as one
    thread would raise it, after every thread has let go of `body` (later records may
    have been decoded meanwhile: nothing is written by decoding)."""
    if threads == 1 or len(metas) < 2:
        dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        return [_decode_record(m, body, dctx, baselines) for m in metas]
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="nemo-dcr-decode")
    futures = [pool.submit(_decode_record_here, m, body, baselines) for m in metas]
    records = []
    try:
        for f in futures:  # a loop, not a comprehension: see below
            records.append(f.result())
    finally:
        for f in futures:
            f.cancel()  # after a failure: records not started yet are not decoded,
        wait(futures)  # and those running are waited for: nothing may read `body` after this
        # A failure's traceback holds this frame; the futures hold the failures (whose frames
        # hold `body`): with both here, a reference cycle would keep the caller's buffer
        # exported until a garbage collection (a transport unmaps it on release).
        del f, futures
    return records


def _decode_record_here(m: RecordMeta, body: memoryview, baselines: conditioned.BaselineSource | None) -> Record:
    """`_decode_record` with this pool thread's own decompressor (one is not shared)."""
    dctx = getattr(_thread_state, "dctx", None)
    if dctx is None:
        dctx = _thread_state.dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
    return _decode_record(m, body, dctx, baselines)


def _decode_record(m: RecordMeta, body: memoryview, dctx: zstandard.ZstdDecompressor,
                   baselines: conditioned.BaselineSource | None = None) -> Record:
    where = f"record {m.name!r}"
    if m.baseline is not None:
        return _decode_conditioned(m, body, dctx, where, baselines)
    nvals = m.numel if m.positions_encoding == "dense" else m.count
    pos = gaps = None
    if m.positions_encoding not in ("all", "dense"):
        assert m.positions is not None
        raw = section_bytes(body, m.positions, f"{where} positions", dctx)
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
            raise Malformed(f"{where}: dense values hold {nz.size} changes, header declares count {m.count}")
        pos, vals = nz.astype(np.uint64), vals[nz]
    elif pos is None:
        pos = np.arange(m.count, dtype=np.uint64)
    if not vals.flags.writeable:
        vals = vals.copy()
    return Record(m.name, m.dtype.name, m.shape, m.op, pos, vals)


def _decode_conditioned(m: RecordMeta, body: memoryview, dctx: zstandard.ZstdDecompressor, where: str,
                        baselines: conditioned.BaselineSource | None) -> Record:
    b = m.baseline
    span = f"{m.name}[{b.lo}:{b.lo + b.n}]"
    bits = baselines.bits(m.name, b.lo, b.lo + b.n) if baselines is not None else None
    if bits is None:
        raise Malformed(f"{where} is coded against the committed bits of {span}, which this receiver "
                        "does not hold (a runtime without them keeps a canonical mirror: docs/wire-format.md)")
    if conditioned.baseline_digest(bits) != b.xxh3:
        raise Malformed(f"{where}: the producer coded it against other bits of {span} than this receiver "
                        "holds (baseline digest differs): not decoded, nothing written")
    psec = section_bytes(body, m.positions, f"{where} positions", dctx)
    vsec = section_bytes(body, m.values, f"{where} values", dctx)
    with _AsBad(f"{where} conditioned"):
        pos, vals = conditioned.decode_conditioned(np.frombuffer(psec, np.uint8), np.frombuffer(vsec, np.uint8),
                                                   m.count, m.dtype, m.op, BaseSpan(b.lo, bits))
    return Record(m.name, m.dtype.name, m.shape, m.op, pos, vals.view(m.dtype.bits_numpy))


def _decode_joint(m: RecordMeta, body: memoryview, dctx: zstandard.ZstdDecompressor, where: str,
                  gaps: GapsReader) -> Record:
    """A `gaps_joint` / `symbols_joint` record: both sections read up to their models, then
    the joint stream (in the positions section; its errors are the positions')."""
    with _AsBad(f"{where} values"):
        values = ValuesReader(section_bytes(body, m.values, f"{where} values", dctx), m.count, m.dtype, where,
                              coding="joint")
        direct = values.direct_table()  # the decoder then writes the values, not their symbols
    with _AsBad(f"{where} positions"):
        pos, second = decode_joint_gaps(gaps, values.model, m.numel, direct)
    with _AsBad(f"{where} values"):
        vals = second if direct is not None else values.values(second)
    return Record(m.name, m.dtype.name, m.shape, m.op, pos, vals)


def _decode_prefix(m: RecordMeta, body: memoryview, dctx: zstandard.ZstdDecompressor, where: str,
                   gaps: prefix.PrefixGaps) -> Record:
    """A `gaps_prefix` / `symbols_prefix` record: both sections read up to their codes, then
    the bit stream (in the positions section; its errors are the positions')."""
    with _AsBad(f"{where} values"):
        values = ValuesReader(section_bytes(body, m.values, f"{where} values", dctx), m.count, m.dtype, where,
                              coding="prefix")
    with _AsBad(f"{where} positions"):
        qsym, gaps_, vsym = gaps.split(values.model)
        pos = gaps.positions(qsym, gaps_, m.numel)
    with _AsBad(f"{where} values"):
        vals = values.values(vsym)
    return Record(m.name, m.dtype.name, m.shape, m.op, pos, vals)


class _AsBad:
    """Context: a PositionsError inside becomes Malformed(f"{where}: {reason}")."""

    def __init__(self, where: str):
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: Any, e: BaseException | None, tb: Any) -> None:
        if isinstance(e, PositionsError):
            raise Malformed(f"{self.where}: {e}") from None


def _paired_values(m: RecordMeta, body: memoryview, dctx: zstandard.ZstdDecompressor, where: str,
                   gaps: GapsReader | None) -> ValuesReader | None:
    """The values section read up to its symbols when the record's two rANS streams can be
    decoded in one pass (gaps_rans + symbols_rans, both with words, at least _PAIR_MIN
    changes), else None. A values section that fails here is left to `_decode_values`,
    after the positions, so that errors come in the same order either way."""
    if gaps is None or m.values_encoding != "symbols_rans" or m.count < _PAIR_MIN or gaps.stream.words is None:
        return None
    try:
        values = ValuesReader(section_bytes(body, m.values, f"{where} values", dctx), m.count, m.dtype, where)
    except (Malformed, PositionsError):
        return None
    return values if values.stream.words is not None else None


def _decode_values(m: RecordMeta, body: memoryview, dctx: zstandard.ZstdDecompressor, where: str,
                   nvals: int) -> np.ndarray:
    vraw = section_bytes(body, m.values, f"{where} values", dctx)
    if m.values_encoding == "symbols_rans":
        with _AsBad(f"{where} values"):
            return decode_value_symbols(vraw, nvals, m.dtype, where)
    return decode_planes(vraw, nvals, m.dtype)
