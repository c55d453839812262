"""Decoder fuzzing: mutated payloads must give clean rejections, never a crash, a hang,
a memory blow-up or a written byte.

    python -m tests.fuzz_decoder --cases 100000          # the long run (a few minutes)
    python -m tests.fuzz_decoder --cases 2000 --seed 3   # what CI runs (tests/test_decoder_fuzz.py)

A corpus of valid payloads (every encoding the encoder writes: sparse and dense,
gap-coded and run-coded positions, rANS-coded and byte-plane values, stored and zstd
sections, xor / add / overwrite, several dtypes, signed and unsigned; format v5, the
default, with joint streams for its larger records, the same records in two rANS streams
and as v6's prefix-coded streams) is
mutated in ways that reach every layer of the decoder:
* raw damage: truncation, bit flips, byte runs overwritten, bytes inserted or deleted;
* resealed damage (the checksum of the payload's format version, and the HMAC where the
  fuzzer holds the key, are recomputed after the change, as a forger would): a body byte
  changed, a header field lied about (dtype, shape, count, op, lengths and offsets up to
  2^62, the stored flag, record name, versions, ids), a section swapped for one declaring a
  huge decompressed size (a decompression bomb), positions pushed past the tensor's end,
  the format version changed;
* forged signatures: a payload signed with another key, or with the signature stripped.
Each mutated payload is decoded against a receiver's catalog and expected transfer, in
this process, under an address-space limit (so a blow-up shows as MemoryError) and a
per-case alarm (a hang shows as a timeout). A decode that succeeds is then applied to a
tensor-store runtime (a payload the forger could have produced legitimately); a decode
that fails must be `PayloadRejected` (a receiver stages only decoded payloads and applies
nothing from a transfer with a rejected payload: tests/test_receiver_rejects.py). The
runtime's bits are compared with their start at the end. Outcome counts are printed as
a table; any crash, hang or memory error is listed with its seed and mutation.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import random
import resource
import signal
import struct
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import xxhash
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nemo_dcr import dtypes  # noqa: E402
from nemo_dcr.errors import PayloadRejected  # noqa: E402
from nemo_dcr.records import Op, Payload, PayloadHeader, Record  # noqa: E402
from nemo_dcr.runtimes.store import TensorStoreRuntime  # noqa: E402
from nemo_dcr.receiver import CommittedBits  # noqa: E402
from nemo_dcr.records import BaseSpan  # noqa: E402
from nemo_dcr.wire import codec  # noqa: E402
from nemo_dcr.wire.frame import FLAG_HEADER_ZSTD  # noqa: E402

KEY = b"fuzz-key"
HEADER = PayloadHeader("t-fuzz", 4, 5, "p0", "p0-000001")
EXPECTED = codec.Expected("t-fuzz", 4, 5)
SHAPES = {"a": ("BF16", (64, 96)), "b": ("F32", (1000,)), "c": ("BF16", (3, 5, 7)), "d": ("I8", (4096,)),
          "e": ("F8_E4M3", (128, 128)), "f": ("BF16", (256, 512))}
CATALOG = {n: (d, tuple(s)) for n, (d, s) in SHAPES.items()}
FRAME_HEAD = struct.Struct("<4sHHI")


def _record(rng: np.random.Generator, name: str, op: Op, rate: float) -> Record:
    dtype, shape = SHAPES[name]
    d = dtypes.from_name(dtype)
    numel = int(np.prod(shape))
    k = max(1, int(numel * rate))
    pos = np.sort(rng.choice(numel, size=k, replace=False)).astype(np.uint64)
    width = np.iinfo(d.bits_numpy).max
    if op is Op.OVERWRITE:
        vals = rng.integers(0, width, size=k, dtype=d.bits_numpy, endpoint=True)
    else:  # ±1 ULP style: a few distinct small values
        vals = rng.choice(np.array([1, 2, 3, width], dtype=d.bits_numpy), size=k, p=[0.7, 0.1, 0.05, 0.15])
    return Record(name, dtype, shape, op, pos, vals)


def corpus(seed: int = 0) -> list[tuple[bytes, bytes | None]]:
    """Valid payloads (data, key) covering the encodings the encoder chooses."""
    rng = np.random.default_rng(seed)
    out = []
    for rate in (0.001, 0.03, 0.3, 1.0):
        for op in (Op.XOR, Op.ADD, Op.OVERWRITE):
            names = ["a", "b"] if rate < 0.5 else ["c", "d"]
            recs = [_record(rng, n, op, rate) for n in names] + ([_record(rng, "e", op, rate)] if rate < 0.1 else [])
            for key in (None, KEY):
                data = codec.encode(Payload(HEADER, recs), key=key)
                out.append((data, key))
    # Records of >= 4096 changes: one joint stream (v5), two streams (where the joint stream
    # would not pay), and (handed to the codec as tensors) one prefix-coded bit stream (v6).
    for op in (Op.XOR, Op.ADD):
        recs = [_record(rng, "f", op, 0.05)]
        tensors = [Record(r.name, r.dtype, r.shape, r.op, torch.from_numpy(r.positions.astype(np.int64)),
                          torch.from_numpy(r.values.view(np.int16))) for r in recs]
        for key in (None, KEY):
            out.append((codec.encode(Payload(HEADER, recs), key=key), key))
            with _two_streams():
                out.append((codec.encode(Payload(HEADER, recs), key=key), key))
            out.append((codec.encode(Payload(HEADER, tensors), key=key, version=6), key))
    # Every tensor in one payload: a header long enough to travel compressed (flag bit 1).
    recs = [_record(rng, n, Op.XOR, 0.03) for n in SHAPES]
    out.append((codec.encode(Payload(HEADER, recs), key=KEY), KEY))
    # Records coded against the receiver's bits (nemo_dcr.wire.conditioned): "f" holds weights.
    old = F_BITS.numpy().view(np.uint16).reshape(-1)
    w = F_BITS.view(torch.bfloat16).float()
    new = (w + torch.randn(w.shape, generator=torch.Generator().manual_seed(seed)).sign() * 3e-5).bfloat16()
    new = new.view(torch.int16).numpy().view(np.uint16).reshape(-1)
    pos = np.flatnonzero(old != new)
    for op in (Op.XOR, Op.ADD):
        vals = old[pos] ^ new[pos] if op is Op.XOR else (new[pos] - old[pos]).astype(np.uint16)
        data = codec.encode(Payload(HEADER, [Record("f", "BF16", SHAPES["f"][1], op, pos.astype(np.uint64), vals,
                                                    base=BaseSpan(0, old))]))
        assert "gaps_conditioned" in codec.header_text(data)
        out.append((data, None))
    out.append((codec.encode(Payload(HEADER, []), key=None), None))
    return out


@contextlib.contextmanager
def _two_streams():
    """The encoder with the joint stream turned down: large records in two rANS streams."""
    saved = codec.encode_joint
    codec.encode_joint = lambda *args: None
    try:
        yield
    finally:
        codec.encode_joint = saved


# --- mutations ----------------------------------------------------------------------------

def _split(data: bytes):
    magic, version, flags, hlen = FRAME_HEAD.unpack_from(data)
    hbytes = data[12:12 + hlen]
    if flags & FLAG_HEADER_ZSTD:
        hbytes = zstandard.ZstdDecompressor().decompress(hbytes)
    header = json.loads(hbytes)
    body_len = header.get("body_bytes", 0)
    body = data[12 + hlen:12 + hlen + body_len]
    return version, flags, header, body


def _seal(version: int, flags: int, header: dict, body: bytes, key: bytes | None) -> bytes:
    hbytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    if flags & FLAG_HEADER_ZSTD:
        hbytes = zstandard.ZstdCompressor(write_content_size=True).compress(hbytes)
    head = FRAME_HEAD.pack(b"NDCR", version, flags, len(hbytes)) + hbytes + body
    out = head + xxhash.xxh3_128_digest(head)  # for the versions a decoder must refuse too
    if flags & 1:
        out += hmac.new(key or b"", out, hashlib.sha256).digest()
    return out


HUGE = [2**31, 2**32 + 5, 2**40, 2**62, -1, 0, 1]


def _lie(rng: random.Random, header: dict) -> str:
    """Change one header field to something it must not be; returns what was done."""
    recs = header.get("records") or []
    if not recs or rng.random() < 0.15:
        field = rng.choice(["transfer_id", "base_version", "target_version", "payload_id", "producer_id",
                            "raw_bytes", "body_bytes", "extra"])
        header[field] = rng.choice([*HUGE, "", "x" * 300, None, 1.5, True, [], {}])
        return f"header.{field}"
    rec = rng.choice(recs)
    choice = rng.choice(["dtype", "shape", "count", "op", "name", "positions", "values", "extra"])
    if choice == "dtype":
        rec["dtype"] = rng.choice(["BF16", "F32", "I8", "F8_E4M3", "U64", "", 3])
    elif choice == "shape":
        rec["shape"] = rng.choice([[], [0], [1], [2**40, 2**40], [-3], [7, 7], "x", [2**62]])
    elif choice == "count":
        rec["count"] = rng.choice([*HUGE, rec.get("count", 0) + 1])
    elif choice == "op":
        rec["op"] = rng.choice(["xor", "add", "overwrite", "mul", "", None])
    elif choice == "name":
        rec["name"] = rng.choice(["z", "a", "b", "", "../etc", "a" * 5000])
    elif choice in ("positions", "values"):
        sec = rec.get(choice) or {}
        key = rng.choice(sorted(set(sec) | {"stored"}))  # "stored" also where the section has none
        sec[key] = rng.choice([*HUGE, "runs", "all", "dense", "gaps_rans", "symbols_rans", "planes", "nope",
                               None, [], 3, True, False])
        return f"record.{choice}.{key}"
    else:
        rec["surprise"] = 1
    return f"record.{choice}"


_BOMBS: dict[int, bytes] = {}


def _bomb_frame(size: int) -> bytes:
    """A valid zstd frame that decompresses to `size` zero bytes (a few KiB on the wire)."""
    if size not in _BOMBS:
        cobj = zstandard.ZstdCompressor(level=3, write_content_size=True).compressobj(size=size)
        zero, parts = bytes(1 << 20), []
        for _ in range(size >> 20):
            parts.append(cobj.compress(zero))
        parts.append(cobj.flush())
        _BOMBS[size] = b"".join(parts)
    return _BOMBS[size]


def _bomb(header: dict, body: bytes, rng: random.Random) -> tuple[dict, bytes, str]:
    """Replace a section by a decompression bomb declaring its true, huge size."""
    recs = header.get("records") or []
    if not recs:
        return header, body, "bomb-skipped"
    rec = rng.choice(recs)
    which = rng.choice(["positions", "values"])
    sec = rec[which]
    size = rng.choice([256 << 20, 1 << 30, 4 << 30])
    frame = _bomb_frame(size)
    start, delta = sec["offset"], len(frame) - sec["length"]
    body = body[:start] + frame + body[start + sec["length"]:]
    for r in recs:  # later sections move
        for w in ("positions", "values"):
            if r[w] is not sec and r[w].get("offset", 0) > start:
                r[w]["offset"] += delta
    sec["length"], sec["raw_length"] = len(frame), size
    sec.pop("stored", None)  # the bomb is a zstd frame
    header["body_bytes"] = len(body)
    header["raw_bytes"] = sum(r[w].get("raw_length", 0) for r in recs for w in ("positions", "values"))
    return header, body, f"bomb-{which}-{size >> 20}MiB"


def mutate(data: bytes, key: bytes | None, rng: random.Random) -> tuple[bytes, bytes | None, str]:
    """One mutated payload, the key the receiver holds, and a label of the mutation."""
    kind = rng.choice(["truncate", "flip", "overwrite", "insert", "delete", "reseal-body", "reseal-lie",
                       "reseal-lie2", "bomb", "wrong-key", "strip-mac", "version"])
    b = bytearray(data)
    if kind == "truncate":
        return bytes(b[:rng.randrange(len(b))]), key, kind
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b), key, kind
    if kind == "overwrite":
        i = rng.randrange(len(b))
        n = rng.randint(1, 16)
        b[i:i + n] = bytes(rng.randrange(256) for _ in range(n))
        return bytes(b), key, kind
    if kind == "insert":
        i = rng.randrange(len(b) + 1)
        return bytes(b[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 32))) + b[i:]), key, kind
    if kind == "delete":
        i = rng.randrange(len(b))
        return bytes(b[:i] + b[i + rng.randint(1, 32):]), key, kind
    version, flags, header, body = _split(data)
    if kind == "version":
        others = [v for v in (0, 1, 2, 3, 4, 5, 6, 7, 65535) if v != version]  # 5 <-> 6: v6's rules apply
        return _seal(rng.choice(others), flags, header, body, key), key, kind
    if kind == "wrong-key":
        return _seal(version, flags | 1, header, body, b"another-key"), KEY, kind
    if kind == "strip-mac":
        return _seal(version, flags & ~1, header, body, None), KEY, kind
    if kind == "reseal-body":
        if not body:
            return _seal(version, flags, header, body, key), key, kind
        body = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(body))
            body[i] ^= 1 << rng.randrange(8)
        return _seal(version, flags, header, bytes(body), key), key, kind
    if kind in ("reseal-lie", "reseal-lie2"):
        what = [_lie(rng, header) for _ in range(1 if kind == "reseal-lie" else 2)]
        return _seal(version, flags, header, body, key), key, f"{kind}:{'+'.join(what)}"
    header, body, what = _bomb(header, body, rng)
    return _seal(version, flags, header, body, key), key, what


# --- running ------------------------------------------------------------------------------

class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


# The receiver's weights of "f" (BF16 bits of N(0, 0.02)): what conditioned records decode against.
F_BITS = (torch.randn(SHAPES["f"][1], generator=torch.Generator().manual_seed(5)) * 0.02).bfloat16().view(torch.int16)


def store() -> TensorStoreRuntime:
    tensors = {n: torch.zeros(shape, dtype=dtypes.from_name(d).torch_dtype) for n, (d, shape) in SHAPES.items()}
    tensors["f"] = F_BITS.clone().view(torch.bfloat16)
    return TensorStoreRuntime(tensors)


def run(cases: int, seed: int = 0, *, memory_gb: float = 3.0, per_case_s: float = 5.0, log=print) -> dict:
    """Fuzz `cases` mutated payloads; returns the outcome counts and the failures."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = int(memory_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    rng = random.Random(seed)
    seeds = corpus(seed)
    outcomes: Counter = Counter()
    by_kind: Counter = Counter()
    failures: list[dict] = []
    runtime = store()
    reference = {n: dtypes.bits_of(t).clone() for n, t in runtime.canonical_state().items()}
    t0 = time.perf_counter()
    try:
        for i in range(cases):
            data, key = seeds[rng.randrange(len(seeds))]
            try:
                mutated, rx_key, label = mutate(data, key, rng)
            except (ValueError, KeyError, TypeError, zlib.error):
                continue  # a mutation that could not be built (e.g. a header no longer JSON)
            by_kind[label.split(":")[0]] += 1
            signal.setitimer(signal.ITIMER_REAL, per_case_s)
            try:
                payload = codec.decode(mutated, key=rx_key, catalog=CATALOG, expected=EXPECTED,
                                       baselines=CommittedBits(runtime, None))
                log_undo = runtime.apply(payload.records)  # a payload a forger could have made validly
                runtime.revert(log_undo)
                outcomes["accepted (valid after mutation)"] += 1
            except PayloadRejected:
                outcomes["rejected cleanly"] += 1
            except _Hang:
                outcomes["HANG"] += 1
                failures.append({"case": i, "seed": seed, "mutation": label, "error": "timeout"})
            except MemoryError:
                outcomes["MEMORY"] += 1
                failures.append({"case": i, "seed": seed, "mutation": label, "error": "MemoryError"})
            except Exception as e:  # noqa: BLE001 - anything else is a decoder bug
                outcomes["CRASH"] += 1
                failures.append({"case": i, "seed": seed, "mutation": label, "error": f"{type(e).__name__}: {e}"})
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if (i + 1) % 20000 == 0:
                log(f"[fuzz] {i + 1}/{cases} cases, {time.perf_counter() - t0:.0f} s, {dict(outcomes)}")
        untouched = all(torch.equal(dtypes.bits_of(t), reference[n]) for n, t in runtime.canonical_state().items())
    finally:
        signal.signal(signal.SIGALRM, old_handler)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return {"cases": cases, "seconds": time.perf_counter() - t0, "outcomes": dict(outcomes),
            "mutations": dict(by_kind), "failures": failures, "runtime_untouched": untouched}


def table(result: dict) -> str:
    lines = [f"{result['cases']} mutated payloads in {result['seconds']:.1f} s",
             "| outcome | payloads |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(result["outcomes"].items())]
    lines += ["", "| mutation | payloads |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(result["mutations"].items())]
    lines.append(f"\nruntime bits untouched after every rejection and revert: {result['runtime_untouched']}")
    for f in result["failures"][:20]:
        lines.append(f"FAILURE case {f['case']} (seed {f['seed']}): {f['mutation']}: {f['error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    result = run(args.cases, args.seed)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    bad = result["outcomes"].get("CRASH", 0) + result["outcomes"].get("HANG", 0) + result["outcomes"].get("MEMORY", 0)
    return 0 if bad == 0 and result["runtime_untouched"] else 1


if __name__ == "__main__":
    sys.exit(main())
