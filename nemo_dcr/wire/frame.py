"""The payload's frame (docs/wire-format.md, "Byte layout"): the frame head, the body's
sections, the checksum and HMAC trailer. All integers little-endian:

    offset          size   field
    0               4      magic b"NDCR"
    4               2      u16 format version: 5 (the host format) or 6 (the device format)
    6               2      u16 flags; bit 0 = HMAC present, bit 1 = header zstd-compressed,
                           bit 2 = device checksum (version 6 only, never with bit 0),
                           other bits must be 0
    8               4      u32 header length H (as it is on the wire)
    12              H      header: JSON, UTF-8, sorted keys, no whitespace (`header`); with
                           flag bit 1, one zstd frame of it that declares its content size
    12+H            B      body: sections, back to back, in record order
                           (each record: positions section, then values section)
    12+H+B          16     XXH3-128 of bytes [0, 12+H+B), xxh3_128_digest (big-endian);
                           with flag bit 2, the device checksum of them (`device_checksum`)
    12+H+B+16       32     HMAC-SHA256 of bytes [0, 12+H+B+16)   (only if flag bit 0)

The first 12 bytes are the frame head; B is `body_bytes` in the header. Each non-empty
section is either stored (its header entry says "stored": true; its raw bytes, length ==
raw_length) or exactly one zstd frame that declares its content size; an empty section
(raw length 0) has no bytes at all.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import warnings
from typing import Any

import torch
import xxhash
import zstandard

from ..errors import PayloadRejected
from .errors import Malformed
from .header import DecodeLimits, Section
from .versions import DEVICE_FORMAT, READABLE_VERSIONS, readable_versions_text


MAGIC = b"NDCR"
FLAG_HMAC = 0x0001
FLAG_HEADER_ZSTD = 0x0002
FLAG_DEVICE_CHECKSUM = 0x0004
FLAGS = FLAG_HMAC | FLAG_HEADER_ZSTD | FLAG_DEVICE_CHECKSUM
# Headers of at least this many bytes are sent zstd-compressed when that is smaller: a
# payload of many records repeats every record's keys (~250 bytes a record as JSON).
HEADER_ZSTD_MIN = 1024
FRAME_HEAD = struct.Struct("<4sHHI")
FRAME_HEAD_BYTES = FRAME_HEAD.size  # 12
CHECKSUM_BYTES = 16
HMAC_BYTES = 32


_ZSTD_FRAME_MAGIC = b"\x28\xb5\x2f\xfd"
# Frames we write use far smaller windows (level 19: 8 MiB); a larger declared window
# is refused rather than allocated.
MAX_WINDOW = 1 << 27


def checksum(*parts: Any) -> bytes:
    """XXH3-128 of bytes [0, 12+H+B), given as one or more consecutive parts (hashed as they
    are, not joined first); CHECKSUM_BYTES long. Why XXH3: an integrity check only (the HMAC
    authenticates), and it runs at tens of GB/s."""
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.digest()


# The device checksum: four sums modulo the prime 2**31 - 1 of the frame's little-endian
# 16-bit words w_1..w_n (an odd last byte is a word of its own), weighted by i**0..i**3:
# integer arithmetic a GPU does with torch ops, where XXH3 has no device implementation.
DEVICE_CHECKSUM_PRIME = (1 << 31) - 1
_DEVICE_CHECKSUM_CHUNK = 1 << 22  # words per pass: bounds the int64 temporaries


def device_checksum(data: torch.Tensor) -> bytes:
    """The device checksum (flag bit 2) of a 1-D uint8 tensor on any device; CHECKSUM_BYTES
    long: the four sums as u32, little-endian. Like XXH3 here, an integrity check only: a
    changed 16-bit word always changes the first sum (its change is below the prime), and
    the weighted sums catch words moved or swapped."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"device_checksum takes a 1-D uint8 tensor, got {data.dtype} of shape {tuple(data.shape)}")
    n = data.numel()
    words = data[:n - n % 2].view(torch.int16)
    p = DEVICE_CHECKSUM_PRIME
    sums = torch.zeros(4, dtype=torch.int64, device=data.device)
    for at in range(0, words.numel(), _DEVICE_CHECKSUM_CHUNK):
        w = words[at:at + _DEVICE_CHECKSUM_CHUNK].to(torch.int64) & 0xFFFF
        sums += _weighted_sums(w, at + 1, p)
    if n % 2:
        sums += _weighted_sums(data[n - 1:].to(torch.int64), n // 2 + 1, p)
    return (sums % p).to(torch.int32).cpu().numpy().astype("<u4").tobytes()


def _weighted_sums(w: torch.Tensor, first: int, p: int) -> torch.Tensor:
    """sum(w_i * i**k mod p) for k = 0..3, i = first, first+1, ... (each term < 2**31:
    no int64 sum of a chunk overflows)."""
    i = torch.arange(first, first + w.numel(), dtype=torch.int64, device=w.device) % p
    i2 = i * i % p
    return torch.stack([w.sum(), (w * i % p).sum(), (w * i2 % p).sum(), (w * (i2 * i % p) % p).sum()]) % p


def key_bytes(key: bytes) -> bytes:
    k = bytes(key)
    if not k:
        raise ValueError("empty HMAC key")
    return k


def seal(version: int, hbytes: bytes, sections: list, key: bytes | None) -> bytes:
    """The payload: frame head, header, sections (chunks in order: bytes-like, or uint8
    tensors, copied to the host here), checksum and, with a key, the HMAC (flag bit 0). A
    long header goes compressed (flag bit 1)."""
    flags = FLAG_HMAC if key is not None else 0
    head, hbytes = _head(version, flags, hbytes)
    # Checksum and HMAC over the parts as they are, then one join: no whole-payload copies.
    parts = [head, hbytes, *(c.cpu().numpy() if isinstance(c, torch.Tensor) else c for c in sections)]
    parts.append(checksum(*parts))
    if key is not None:
        mac = hmac.new(key_bytes(key), digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        parts.append(mac.digest())
    return b"".join(parts)


def seal_on_device(version: int, hbytes: bytes, sections: list, device: torch.device) -> torch.Tensor:
    """The payload as `seal` lays it out, built on `device` as one uint8 tensor: the
    sections' tensor chunks are copied there device to device, the rest (frame head,
    header, the small tables of the sections) uploaded, each run of them in one copy. The
    trailer is the device checksum (flag bit 2), computed there; such a frame is never
    signed (an HMAC needs the bytes on the host)."""
    if version != DEVICE_FORMAT:
        raise ValueError(f"a payload sealed on a device is format {DEVICE_FORMAT}, got version {version}")
    head, hbytes = _head(version, FLAG_DEVICE_CHECKSUM, hbytes)
    runs: list = [[head, hbytes]]  # host chunks joined into runs, tensors as they are
    for c in sections:
        if isinstance(c, torch.Tensor):
            runs.append(c)
        elif isinstance(runs[-1], list):
            runs[-1].append(c)
        else:
            runs.append([c])
    sizes = [r.numel() if isinstance(r, torch.Tensor) else sum(memoryview(c).nbytes for c in r) for r in runs]
    body_end = sum(sizes)
    out = torch.empty(body_end + CHECKSUM_BYTES, dtype=torch.uint8, device=device)
    at = 0
    for r, size in zip(runs, sizes):
        if size:
            if isinstance(r, torch.Tensor):
                out[at:at + size].copy_(r.view(torch.uint8).reshape(-1))
            else:
                out[at:at + size].copy_(torch.frombuffer(bytearray(b"".join(r)), dtype=torch.uint8))
        at += size
    trailer = device_checksum(out[:body_end])
    out[body_end:].copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8))
    return out


def _head(version: int, flags: int, hbytes: bytes) -> tuple[bytes, bytes]:
    """(frame head, header as sent): a long header goes zstd-compressed (flag bit 1) when
    that is smaller."""
    if len(hbytes) >= HEADER_ZSTD_MIN:
        packed = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(hbytes)
        if len(packed) < len(hbytes):
            hbytes, flags = packed, flags | FLAG_HEADER_ZSTD
    return FRAME_HEAD.pack(MAGIC, version, flags, len(hbytes)), hbytes


def check_trailer(mv: memoryview, end: int, flags: int, key: bytes | None) -> None:
    """Malformed unless the checksum of bytes [0, end) matches (XXH3-128, or with flag bit
    2 the device checksum), and, where a key is configured (key_bytes(key)), the HMAC after
    it. A signed payload with no key to verify it is refused too."""
    if flags & FLAG_DEVICE_CHECKSUM:
        with warnings.catch_warnings():  # read only: the tensor is never written
            warnings.simplefilter("ignore", UserWarning)
            got = device_checksum(torch.frombuffer(mv[:end], dtype=torch.uint8))
        if not hmac.compare_digest(got, mv[end:end + CHECKSUM_BYTES]):
            raise Malformed("checksum mismatch (device checksum): payload corrupt or truncated")
    elif not hmac.compare_digest(checksum(mv[:end]), mv[end:end + CHECKSUM_BYTES]):
        raise Malformed("checksum mismatch (XXH3-128): payload corrupt or truncated")
    signed = bool(flags & FLAG_HMAC)
    if signed and key is None:
        raise Malformed("payload carries an HMAC but no key is configured to verify it")
    if key is not None:
        if not signed:
            raise Malformed("HMAC missing: a key is configured but the payload is unsigned")
        end += CHECKSUM_BYTES
        mac = hmac.new(key, mv[:end], hashlib.sha256).digest()
        if not hmac.compare_digest(mac, mv[end:end + HMAC_BYTES]):
            raise Malformed("HMAC mismatch: payload forged or signed with another key")


def bytes_view(data: Any) -> memoryview:
    try:
        mv = memoryview(data)
        return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    except TypeError as e:
        raise PayloadRejected(None, f"payload must be contiguous bytes ({e})") from None


def parse_frame_head(mv: memoryview, limits: DecodeLimits) -> tuple[int, int, int, int]:
    """(version, flags, header length, body length) from the frame head and total length."""
    n = len(mv)
    if n > limits.max_payload_bytes:
        raise Malformed(f"payload of {n} bytes exceeds limit max_payload_bytes={limits.max_payload_bytes}")
    if n >= 4 and bytes(mv[:4]) != MAGIC:
        raise Malformed(f"bad magic {bytes(mv[:4])!r} (expected {MAGIC!r})")
    if n < FRAME_HEAD_BYTES:
        raise Malformed(f"truncated: {n} bytes, shorter than the {FRAME_HEAD_BYTES}-byte frame head")
    _, version, flags, hlen = FRAME_HEAD.unpack(mv[:FRAME_HEAD_BYTES])
    if version not in READABLE_VERSIONS:
        raise Malformed(f"unsupported format version {version} (this decoder reads {readable_versions_text()})")
    if flags & ~FLAGS:
        raise Malformed(f"unknown flag bits 0x{flags & ~FLAGS:04x}")
    if flags & FLAG_DEVICE_CHECKSUM and (version != DEVICE_FORMAT or flags & FLAG_HMAC):
        raise Malformed(f"flag bit 2 (device checksum) is only valid in format {DEVICE_FORMAT} "
                        f"and never with an HMAC (version {version}, flags 0x{flags:04x})")
    if hlen > limits.max_header_bytes:
        raise Malformed(f"header of {hlen} bytes exceeds limit max_header_bytes={limits.max_header_bytes}")
    trailer = CHECKSUM_BYTES + (HMAC_BYTES if flags & FLAG_HMAC else 0)
    body_len = n - FRAME_HEAD_BYTES - hlen - trailer
    if body_len < 0:
        raise Malformed(f"truncated: {n} bytes cannot hold the {hlen}-byte header and {trailer}-byte trailer")
    return version, flags, hlen, body_len


def header_json(mv: memoryview, flags: int, hlen: int, limits: DecodeLimits) -> bytes:
    """The header's JSON bytes: as they are, or (flag bit 1) its zstd frame decompressed,
    the declared size checked against max_header_bytes first."""
    raw = mv[FRAME_HEAD_BYTES:FRAME_HEAD_BYTES + hlen]
    if not flags & FLAG_HEADER_ZSTD:
        return bytes(raw)
    where = "compressed header"
    size = _declared_size(raw, where)
    if size == zstandard.CONTENTSIZE_UNKNOWN or not 0 < size <= limits.max_header_bytes:
        raise Malformed(f"{where} declares {size} bytes (limit max_header_bytes={limits.max_header_bytes})")
    return _decompress(raw, size, where, zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW))


def _declared_size(frame: memoryview, where: str) -> int:
    """The content size a zstd frame declares (Malformed when it is not one)."""
    if bytes(frame[:4]) != _ZSTD_FRAME_MAGIC:
        raise Malformed(f"{where} is not a zstd frame")
    try:
        return zstandard.get_frame_parameters(frame).content_size
    except zstandard.ZstdError as e:
        raise Malformed(f"{where}: bad zstd frame header ({e})") from None


def _decompress(frame: memoryview, size: int, where: str, dctx: zstandard.ZstdDecompressor) -> bytes:
    """Exactly `size` bytes out of one zstd frame (its declared size, checked by the caller
    before: the output buffer is sized from it), or Malformed."""
    try:
        out = dctx.decompress(frame, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise Malformed(f"{where}: zstd decompression failed ({e})") from None
    if len(out) != size:
        raise Malformed(f"{where}: decompressed to {len(out)} bytes, declared {size}")
    return out


def sniff(hbytes: bytes) -> tuple[str | None, int | None]:
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


def section_bytes(body: memoryview, sec: Section, where: str,
                  dctx: zstandard.ZstdDecompressor) -> bytes | memoryview:
    """The section's exactly sec.raw_length raw bytes, or Malformed. A zstd frame's own claims are not trusted."""
    if sec.raw_length == 0:
        return b""
    frame = body[sec.offset:sec.offset + sec.length]
    if sec.stored:  # read in place; the header parser checked length == raw_length
        return frame
    declared = _declared_size(frame, f"{where} section")
    if declared != sec.raw_length:
        # Checked before decompressing: the output buffer is sized from the frame.
        raise Malformed(f"{where}: zstd frame declares {declared} bytes, header says {sec.raw_length} "
                        "(possible decompression bomb)")
    return _decompress(frame, sec.raw_length, where, dctx)
