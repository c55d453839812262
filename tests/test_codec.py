"""Wire codec v5 and v6: round trips, every rejection reason, and fuzzing (invariant 4)."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_dcr import dtypes, kernels
from nemo_dcr.errors import PayloadRejected
from nemo_dcr.records import Op, Payload, PayloadHeader, Record
from nemo_dcr.wire import codec
from nemo_dcr.wire.codec import FORMAT_VERSION, DecodeLimits, Expected, decode, encode, peek_header
from nemo_dcr.wire.errors import PositionsError
from nemo_dcr.wire.frame import CHECKSUM_BYTES, FLAG_HMAC, FRAME_HEAD_BYTES, HMAC_BYTES, MAGIC, header_json
from nemo_dcr.wire.gaps import decode_gaps_rans, encode_gaps_rans
from nemo_dcr.wire.positions import decode_runs, encode_runs
from nemo_dcr.wire.rans import RansStream, encode_rans, model_bytes, quantize, read_model
from nemo_dcr.wire.varints import Reader, leb128_decode, leb128_encode, leb128_ints

KEY = b"k" * 32
DTYPES = ["BF16", "F16", "F32", "F64", "I64", "I32", "U8", "BOOL", "F8_E4M3"]
HDR = PayloadHeader("xfer-7", 6, 7, "rank3", "rank3-0")


def rec(name, dtype, shape, positions, values=None, op=Op.XOR, seed=0):
    dt = dtypes.from_name(dtype)
    pos = np.asarray(positions, dtype=np.uint64)
    if values is None:
        rng = np.random.default_rng(seed)
        values = rng.integers(0, 256, size=pos.size * dt.itemsize, dtype=np.uint8)
        values = values.view(dt.bits_numpy)
    return Record(name, dtype, tuple(shape), op, pos, np.asarray(values, dtype=dt.bits_numpy))


def payload(*records, header=HDR):
    return Payload(header, list(records))


def assert_same(a: Payload, b: Payload):
    assert a.header == b.header
    assert len(a.records) == len(b.records)
    for x, y in zip(a.records, b.records):
        dt = dtypes.from_name(x.dtype)
        assert (x.name, x.dtype, tuple(x.shape), Op(x.op)) == (y.name, y.dtype, y.shape, y.op)
        assert y.positions.dtype == np.uint64 and y.values.dtype == dt.bits_numpy
        np.testing.assert_array_equal(np.asarray(x.positions, dtype=np.uint64), y.positions)
        np.testing.assert_array_equal(np.asarray(x.values).view(dt.bits_numpy), y.values)


def roundtrip(p: Payload, **kw) -> Payload:
    key = kw.pop("key", None)
    out = decode(encode(p, key=key), key=key, **kw)
    assert_same(p, out)
    return out


def reject(data, reason: str, **kw) -> PayloadRejected:
    with pytest.raises(PayloadRejected) as ei:
        decode(data, **kw)
    assert reason in ei.value.reason, ei.value.reason
    return ei.value


# -------------------------------------------------------------- payload surgery


def split(data: bytes) -> tuple[int, dict, list[dict]]:
    """(flags, header dict, per record {"positions": frame|None, "values": frame})."""
    _, _, flags, hlen = struct.unpack_from("<4sHHI", data)
    header = json.loads(header_json(memoryview(data), flags, hlen, DecodeLimits()))
    body = data[FRAME_HEAD_BYTES + hlen:]
    secs = []
    for r in header["records"]:
        s = {}
        for part in ("positions", "values"):
            m = r[part]
            s[part] = body[m["offset"]:m["offset"] + m["length"]] if "offset" in m else None
        secs.append(s)
    return flags, header, secs


def checksum(data: bytes) -> bytes:
    """The trailer checksum: XXH3-128 (canonical, big-endian)."""
    return xxhash.xxh3_128_digest(data)


def assemble(hbytes: bytes, body: bytes, *, key=None, flags=None, magic=MAGIC, version=FORMAT_VERSION) -> bytes:
    if flags is None:
        flags = FLAG_HMAC if key is not None else 0
    out = struct.pack("<4sHHI", magic, version, flags, len(hbytes)) + hbytes + body
    out += checksum(out)
    if key is not None:
        out += hmac.new(key, out, hashlib.sha256).digest()
    return out


def rejoin(header: dict, secs: list[dict], *, key=None, fix=True, **kw) -> bytes:
    """Lay sections out again (offsets, lengths, totals fixed unless fix=False), reseal."""
    body = b""
    raw = 0
    for r, s in zip(header["records"], secs):
        for part in ("positions", "values"):
            if s.get(part) is None:
                continue
            if fix:
                r[part]["offset"], r[part]["length"] = len(body), len(s[part])
            raw += r[part].get("raw_length", 0)
            body += s[part]
    if fix:
        header["body_bytes"], header["raw_bytes"] = len(body), raw
    hbytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return assemble(hbytes, body, key=key, **kw)


def zc(raw: bytes, **kw) -> bytes:
    return zstandard.ZstdCompressor(level=1, **kw).compress(raw) if raw else b""


def raw_of(meta: dict, frame: bytes) -> bytes:
    """A section's raw bytes: a stored section is its raw bytes, the others one zstd frame."""
    return frame if meta.get("stored") else zstandard.ZstdDecompressor().decompress(frame)


def set_section(header, secs, i, part, raw: bytes, frame: bytes | None = None):
    """Replace a section by `raw`, stored or compressed as the header says (or by `frame`)."""
    meta = header["records"][i][part]
    meta["raw_length"] = len(raw)
    if frame is None:
        frame = raw if meta.get("stored") else zc(raw)
    secs[i][part] = frame


def sample() -> bytes:
    return encode(payload(
        rec("a.weight", "BF16", (8, 16), [0, 1, 2, 9, 50, 127], seed=1),
        rec("b.bias", "F32", (16,), np.arange(16), seed=2),
        rec("c.scale", "U8", (4, 4), [3, 4], op=Op.OVERWRITE, seed=3),
    ))


def edited(edit, data=None, **kw) -> bytes:
    """Decode-free edit of a valid payload: edit(header, secs) then rejoin."""
    _, header, secs = split(sample() if data is None else data)
    edit(header, secs)
    return rejoin(header, secs, **kw)


# -------------------------------------------------------------- round trips


@st.composite
def records(draw, name):
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from(list(Op)))
    shape = tuple(draw(st.lists(st.integers(0, 40), min_size=0, max_size=3)))
    numel = int(np.prod(shape, dtype=np.int64))
    seed = draw(st.integers(0, 2**32 - 1))
    mode = draw(st.sampled_from(["random", "runs", "all", "none", "one"]))
    rng = np.random.default_rng(seed)
    if numel == 0 or mode == "none":
        pos = np.empty(0, np.uint64)
    elif mode == "all":
        pos = np.arange(numel, dtype=np.uint64)
    elif mode == "one":
        pos = np.array([rng.integers(0, numel)], np.uint64)
    elif mode == "random":
        pos = np.flatnonzero(rng.random(numel) < rng.random()).astype(np.uint64)
    else:  # runs: a mask built from blocks
        mask = np.repeat(rng.random(numel // 4 + 1) < 0.5, 4)[:numel]
        mask ^= rng.random(numel) < 0.05
        pos = np.flatnonzero(mask).astype(np.uint64)
    return rec(name, dtype, shape, pos, op=op, seed=seed)


@st.composite
def payloads(draw):
    n = draw(st.integers(0, 4))
    recs = [draw(records(f"model.layers.{i}.w")) for i in range(n)]
    base = draw(st.integers(0, 2**40))
    header = PayloadHeader(draw(st.text(min_size=1, max_size=8)), base, base + 1,
                           "prod", draw(st.text(min_size=1, max_size=8)))
    return Payload(header, recs)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads(), st.booleans())
def test_roundtrip_property(p, signed):
    key = KEY if signed else None
    data = encode(p, key=key)
    assert data == encode(p, key=key)  # deterministic: retries resend identical bytes
    if all(r.positions.size == 0 or int(r.positions[-1]) < 1 << 32 for r in p.records):
        narrow = Payload(p.header, [Record(r.name, r.dtype, r.shape, r.op, r.positions.astype(np.uint32), r.values)
                                    for r in p.records])
        assert encode(narrow, key=key) == data  # uint32 positions (the producer's in place): the same bytes
    assert peek_header(data) == p.header
    out = decode(data, key=key)
    assert_same(p, out)
    catalog = {r.name: (r.dtype, r.shape) for r in p.records}
    decode(data, key=key, catalog=catalog, expected=Expected(
        p.header.transfer_id, p.header.base_version, p.header.target_version))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=50))
def test_leb128_roundtrip(xs):
    edge = [0, 1, 127, 128, 2**63 - 1, 2**63, 2**64 - 1] + [2**(7 * k) - 1 for k in range(1, 10)]
    v = np.array(xs + edge, dtype=np.uint64)
    np.testing.assert_array_equal(leb128_decode(leb128_encode(v)), v)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=8))
def test_leb128_of_python_ints_is_the_arrays_coding(xs):
    """leb128_ints (a header's few sizes) writes the bytes leb128_encode writes for the
    same values as a uint64 array; a negative value is refused, not wrapped."""
    edge = [0, 127, 128, 16383, 16384, 2**63, 2**64 - 1]
    for values in (xs, edge):
        assert leb128_ints(*values) == leb128_encode(np.array(values, np.uint64)).tobytes()
    with pytest.raises(ValueError, match="negative"):
        leb128_ints(3, -1)


def test_model_bytes_with_a_trailer():
    """A stream's header: the alphabet size, every frequency, then the word count (what
    read_model and the stream reader take), as LEB128 varints."""
    freq = np.array([1, 200, 65335], np.int64)
    assert model_bytes(freq) == leb128_encode(np.array([3, 1, 200, 65335], np.uint64)).tobytes()
    assert model_bytes(freq, 70000) == leb128_encode(np.array([3, 1, 200, 65335, 70000], np.uint64)).tobytes()
    decoded = leb128_decode(np.frombuffer(model_bytes(freq.astype(np.uint64), 9), np.uint8))
    assert decoded.tolist() == [3, 1, 200, 65335, 9]


def _read_both_ways(raw: bytes, max_alphabet: int):
    """read_model of raw through the one compiled call and step by step (no numba paths):
    each as (frequencies, cursor after) or the error's message."""
    out = []
    for compiled in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernels.common, "HAVE_NUMBA", compiled and kernels.common.HAVE_NUMBA)
            r = Reader(np.frombuffer(raw, np.uint8))
            r.pos = 1  # a byte before the model, as in a section
            try:
                out.append((read_model(r, max_alphabet, "m").tolist(), r.pos))
            except PositionsError as e:
                out.append(str(e))
    return out


def test_read_model_in_one_call_reads_and_refuses_as_step_by_step():
    """read_model's compiled call (kernels.varints.model_parse) gives the frequencies and cursor of
    the varint-by-varint path for valid models, and for every damaged one the same error:
    an empty or oversized alphabet, a frequency above 2**16, sums off by one, non-minimal
    and truncated varints, models cut short."""
    rng = np.random.default_rng(5)
    valid = [quantize(rng.integers(1, 50, a)) for a in (1, 2, 7, 100, 255, 256)]
    valid += [np.array([0, 65536, 0], np.int64), np.array([65535, 1], np.int64)]
    cases = [(b"\x07" + model_bytes(f, 9) + b"\x01", 256) for f in valid]
    bad = [[0], [3, 1, 2], [2, 65537, 0], [2, 32768, 32767], [2, 32768, 32769], [300] + [218] * 299 + [334]]
    cases += [(b"\x07" + leb128_encode(np.array(b, np.uint64)).tobytes(), 256) for b in bad]
    good = b"\x07" + model_bytes(valid[3])
    cases += [(good[:k], 256) for k in (1, 2, 5, len(good) - 1)]  # cut short
    cases += [(good, 99), (b"\x07\x81\x00\x80\x80\x04", 256), (b"\x07\x01\x80\x80\x84\x00", 256)]  # non-minimal
    for raw, max_alphabet in cases:
        compiled, stepwise = _read_both_ways(raw, max_alphabet)
        assert compiled == stepwise, raw[:12]
    assert _read_both_ways(cases[3][0], 256)[0][0] == valid[3].tolist()
    assert sum(isinstance(_read_both_ways(raw, a)[0], str) for raw, a in cases) == len(cases) - len(valid)
    out = np.empty(256, np.uint64)
    buf = np.frombuffer(cases[4][0], np.uint8)
    parse = kernels.varints.model_parse
    assert parse.py_func(buf, 1, 256, 65536, out) == parse(buf, 1, 256, 65536, out)


def test_rans_slot_table_is_the_prefix_sums_and_repeat():
    """The decoding tables of a stream's model (kernels.rans.rans_slot_table, compiled and as
    Python): numpy's exclusive prefix sums and repeat of each symbol over its slots, zero
    frequencies included, for every output dtype the streams use."""
    rng = np.random.default_rng(6)
    for freq in (quantize(rng.integers(0, 9, 300)), np.array([0, 65536], np.int64), quantize(np.ones(1025))):
        for dtype in (np.uint8, np.int16, np.int32):
            if freq.size > np.iinfo(dtype).max + 1:
                continue
            for fn in (kernels.rans.rans_slot_table, kernels.rans.rans_slot_table.py_func):
                cum, slots = np.empty(freq.size, np.int64), np.empty(65536, dtype)
                fn(freq, cum, slots)
                np.testing.assert_array_equal(cum, np.concatenate([[0], np.cumsum(freq)[:-1]]))
                np.testing.assert_array_equal(slots, np.repeat(np.arange(freq.size, dtype=dtype), freq))
    sym = rng.integers(0, 5, 3000)
    st_ = RansStream.read(Reader(encode_rans(sym, np.bincount(sym))), 8, "t", np.uint8)
    np.testing.assert_array_equal(st_.decode(sym.size), sym)


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 2**63 - 1), max_size=40), st.integers(0, 5))
def test_runs_roundtrip_64bit(s, extra_run):
    pos = sorted(s | {2**63 - 1 - k for k in range(extra_run)})
    p = np.array(pos, dtype=np.uint64)
    np.testing.assert_array_equal(decode_runs(encode_runs(p), p.size, 2**63), p)


@settings(max_examples=100, deadline=None)
@given(st.sets(st.integers(0, 2**63 - 1), max_size=40), st.lists(st.integers(1, 70), max_size=4))
def test_runs_compiled_and_numpy_write_the_same_bytes(s, runs):
    """encode_runs' compiled pass (kernels.varints.runs_leb128, and its plain-Python form) writes
    the bytes of the numpy path, for uint64 positions and uint32 ones: lone positions,
    runs of every length, gaps past 2**32 and up to 2**63 - 1."""
    pos = set(s)
    for k, length in enumerate(runs):
        start = (k + 1) * 1000
        pos |= set(range(start, start + length))
    p = np.array(sorted(pos), dtype=np.uint64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels.common, "HAVE_NUMBA", False)
        numpy_bytes = encode_runs(p)
        if p.size and p[-1] < 2**32:
            assert encode_runs(p.astype(np.uint32)) == numpy_bytes
    assert encode_runs(p) == numpy_bytes
    if p.size and p[-1] < 2**32:
        assert encode_runs(p.astype(np.uint32)) == numpy_bytes
    out = np.empty(20 * max(p.size, 1), np.uint8)
    assert out[:kernels.varints.runs_leb128.py_func(p, out)].tobytes() == numpy_bytes
    assert decode_runs(numpy_bytes, p.size, 2**63).tolist() == p.tolist()


def test_empty_payload():
    p = roundtrip(payload())
    assert p.records == []
    data = encode(payload())
    _, header, _ = split(data)
    assert header["records"] == [] and header["body_bytes"] == 0 and header["raw_bytes"] == 0


def test_zero_changes_and_one_element():
    out = roundtrip(payload(rec("z", "F32", (10, 10), []), rec("one", "BF16", (3, 5), [14])))
    assert len(out.records[0]) == 0 and out.records[1].positions.tolist() == [14]
    _, header, _ = split(encode(payload(rec("z", "F32", (10, 10), []))))
    assert header["records"][0]["positions"]["raw_length"] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_tensor_uses_all_encoding(dtype):
    for shape in [(7, 9), ()]:
        numel = int(np.prod(shape, dtype=np.int64))
        data = encode(payload(rec("full", dtype, shape, np.arange(numel), op=Op.OVERWRITE)))
        _, header, secs = split(data)
        assert header["records"][0]["positions"] == {"encoding": "all"}
        assert secs[0]["positions"] is None
        out = decode(data)
        np.testing.assert_array_equal(out.records[0].positions, np.arange(numel))


def test_decoded_arrays_are_writable():
    out = decode(encode(payload(rec("u", "U8", (9,), [1, 2]), rec("h", "BF16", (9,), [3]))))
    for r in out.records:
        assert r.positions.flags.writeable and r.values.flags.writeable


def test_index_space_beyond_2_31():
    pos = [0, 1, 2**31 - 1, 2**31, 2**31 + 1, 2**32 + 5, 2**40 - 2, 2**40 - 1]
    roundtrip(payload(rec("emb", "BF16", (2**20, 2**20), pos)))


def test_index_space_near_2_63():
    pos = [0, 2**32, 2**62, 2**63 - 3, 2**63 - 2, 2**63 - 1]
    out = roundtrip(payload(rec("huge", "I64", (2**31, 2**32), pos)))
    assert int(out.records[0].positions[-1]) == 2**63 - 1


def test_records_share_a_name_without_overlap():
    roundtrip(payload(rec("w", "BF16", (100,), [1, 5, 9]),
                      rec("w", "BF16", (100,), [2, 6], op=Op.OVERWRITE)))


def test_accepts_memoryview_and_bytearray():
    data = sample()
    decode(memoryview(data))
    decode(bytearray(data))
    assert peek_header(memoryview(data)).payload_id == "rank3-0"


# -------------------------------------------------------------- HMAC


def test_hmac_roundtrip_and_rejections():
    p = payload(rec("w", "BF16", (64,), [3, 4, 5]))
    signed = encode(p, key=KEY)
    assert struct.unpack_from("<H", signed, 6)[0] & FLAG_HMAC
    roundtrip(p, key=KEY)
    reject(signed, "HMAC mismatch", key=b"other key")
    reject(signed, "no key is configured")
    reject(encode(p), "HMAC missing", key=KEY)
    forged = bytearray(signed)
    forged[-1] ^= 1
    reject(bytes(forged), "HMAC mismatch", key=KEY)
    # Downgrade: strip the MAC, clear the flag, recompute the (unkeyed) checksum.
    _, header, secs = split(signed[:-HMAC_BYTES])
    reject(rejoin(header, secs), "HMAC missing", key=KEY)
    # Edit the header and re-sign with a different key: still rejected.
    _, header, secs = split(signed[:-HMAC_BYTES])
    header["target_version"] = 99
    reject(rejoin(header, secs, key=b"attacker"), "HMAC mismatch", key=KEY)
    with pytest.raises(ValueError, match="empty HMAC key"):
        encode(p, key=b"")


# -------------------------------------------------------------- framing


def test_bad_magic_version_flags():
    data = sample()
    e = reject(b"XDCR" + data[4:], "bad magic")
    assert e.payload_id is None
    _, header, secs = split(data)
    reads = "(this decoder reads 5, the host format, and 6, the device format)"
    reject(rejoin(header, secs, version=7), f"unsupported format version 7 {reads}")
    _, header, secs = split(data)
    reject(rejoin(header, secs, version=2), f"unsupported format version 2 {reads}")
    _, header, secs = split(data)
    reject(rejoin(header, secs, version=1), "unsupported format version 1")
    _, header, secs = split(data)
    reject(rejoin(header, secs, flags=0x0008), "unknown flag bits")
    _, header, secs = split(data)
    reject(rejoin(header, secs, flags=0x0004), "flag bit 2 (device checksum) is only valid in format 6")


@pytest.mark.parametrize("cut", [0, 3, 4, 11, 12, 40, -200, -17, -16, -1])
def test_truncated(cut):
    data = sample()
    reject(data[:cut] if cut else b"", "truncated")


def test_truncated_body_names_the_payload():
    e = reject(sample()[:-30], "truncated")
    assert e.payload_id == "rank3-0" and "rank3-0" in str(e)
    reject(sample() + b"\0" * 5, "trailing bytes")


def test_checksum_mismatch():
    data = bytearray(sample())
    data[-CHECKSUM_BYTES - 3] ^= 0x40  # inside the body
    reject(bytes(data), "checksum mismatch (XXH3-128)")
    data = bytearray(sample())
    data[FRAME_HEAD_BYTES + 5] ^= 0x01  # inside the header
    reject(bytes(data), "checksum mismatch")
    data = bytearray(sample())
    data[-1] ^= 0x80  # inside the checksum itself
    reject(bytes(data), "checksum mismatch (XXH3-128)")


def test_checksum_is_xxh3_128_big_endian():
    """The trailer: XXH3-128 (seed 0) of everything before it, in the canonical big-endian form."""
    data = sample()
    core, trailer = data[:-CHECKSUM_BYTES], data[-CHECKSUM_BYTES:]
    assert trailer == xxhash.xxh3_128_intdigest(core).to_bytes(16, "big") == xxhash.xxh3_128_digest(core)
    # The reference test vector (xxHash's XXH3_128bits of empty input), as docs/wire-format.md states it.
    assert xxhash.xxh3_128_digest(b"").hex() == "99aa06d3014798d86001c324468d497f"
    # Another 128-bit digest in its place is a mismatch.
    reject(core + hashlib.blake2b(core, digest_size=CHECKSUM_BYTES).digest(), "checksum mismatch (XXH3-128)")


def test_not_bytes():
    reject(12345, "bytes")


# -------------------------------------------------------------- header schema


def test_malformed_header_json():
    _, _, secs = split(sample())
    body = b"".join(s[p] for s in secs for p in ("positions", "values") if s[p] is not None)
    reject(assemble(b"{not json", body), "malformed header JSON")
    reject(assemble(b"\xff\xfe", body), "not UTF-8")
    reject(assemble(b"[1, 2]", body), "expected a JSON object")
    reject(assemble(b'{"a": 1, "a": 2}', body), "duplicate key")
    reject(assemble(b'{"a": NaN}', body), "non-standard constant")
    reject(assemble(b"[" * 100000 + b"]" * 100000, body), "malformed header")


@pytest.mark.parametrize("edit, reason", [
    (lambda h: h.pop("producer_id"), "missing field(s) ['producer_id']"),
    (lambda h: h.update(compression="lz4"), "unknown field(s) ['compression']"),
    (lambda h: h.update(base_version="6"), "expected an integer"),
    (lambda h: h.update(base_version=6.0), "expected an integer"),
    (lambda h: h.update(base_version=True), "expected an integer"),
    (lambda h: h.update(base_version=-1), "negative"),
    (lambda h: h.update(payload_id=7), "expected a non-empty string"),
    (lambda h: h.update(transfer_id=""), "expected a non-empty string"),
    (lambda h: h.update(target_version=5), "must be >= base_version"),
    (lambda h: h.update(target_version=6), "(an anchor) but a record is not an overwrite"),
    (lambda h: h.update(records={}), "records: expected a list"),
    (lambda h: h["records"][0].pop("op"), "missing field(s) ['op']"),
    (lambda h: h["records"][0].update(crc=1), "unknown field(s) ['crc']"),
    (lambda h: h["records"][0].update(dtype="F4"), "unknown dtype 'F4'"),
    (lambda h: h["records"][0].update(dtype=2), "unknown dtype"),
    (lambda h: h["records"][0].update(op="mul"), "unknown op 'mul'"),
    (lambda h: h["records"][0].update(op=["xor"]), "unknown op ['xor']"),
    (lambda h: h["records"][0].update(op="XOR"), "unknown op 'XOR'"),
    (lambda h: h["records"][0].update(name=""), "name: expected a non-empty string"),
    (lambda h: h["records"][0].update(shape=[8, "16"]), "expected an integer"),
    (lambda h: h["records"][0].update(shape=8), "shape must be a list"),
    (lambda h: h["records"][0].update(shape=[2**32, 2**32]), "more than 2**63"),
    (lambda h: h["records"][0].update(shape=[0, 2**64]), "more than 2**63"),
    (lambda h: h["records"][0].update(count=True), "expected an integer"),
    (lambda h: h["records"][0]["positions"].update(encoding="bitmap"), "unknown position encoding"),
    (lambda h: h["records"][0]["positions"].update(encoding=[]), "unknown position encoding []"),
    (lambda h: h["records"][0]["values"].update(encoding={}), "unknown value encoding {}"),
    (lambda h: h["records"][0]["positions"].update(extra=0), "unknown field(s) ['extra']"),
    (lambda h: h["records"][0]["positions"].pop("raw_length"), "missing field(s) ['raw_length']"),
    (lambda h: h["records"][0]["values"].update(encoding="raw"), "unknown value encoding"),
    (lambda h: h["records"][0]["values"].pop("width"), "missing field(s) ['width']"),
    (lambda h: h["records"][0]["values"].update(width=4), "value width 4 != BF16 itemsize 2"),
    (lambda h: h["records"][1]["positions"].update(encoding="runs"), "missing field(s)"),
])
def test_header_schema(edit, reason):
    reject(edited(lambda h, s: edit(h)), reason)


def test_all_encoding_needs_full_count():
    def edit(h, s):
        h["records"][1]["shape"] = [17]  # 16 changes of 17 elements, still "all"
    reject(edited(edit), "needs count == numel")


# -------------------------------------------------------------- declared sizes


def test_declared_sizes_inconsistent():
    _, h, s = split(sample())
    rejoin(h, s)
    h["raw_bytes"] += 1
    reject(rejoin(h, s, fix=False), "declared raw_bytes")

    _, h, s = split(sample())
    rejoin(h, s)
    h["records"][0]["values"]["offset"] += 1
    reject(rejoin(h, s, fix=False), "sections must be contiguous")

    _, h, s = split(sample())
    rejoin(h, s)
    h["records"][2]["values"]["length"] -= 1
    reject(rejoin(h, s, fix=False), "sections cover")

    _, h, s = split(sample())
    rejoin(h, s)
    h["body_bytes"] += 3
    reject(rejoin(h, s, fix=False), "truncated")


def test_values_count_and_record_count():
    def fewer_values(h, s):
        set_section(h, s, 0, "values", b"\1" * 10)  # 5 values, count 6
    reject(edited(fewer_values), "values count != positions count")

    def count_too_big(h, s):
        h["records"][2]["count"] = 17
    reject(edited(count_too_big), "count 17 > numel 16")

    def count_mismatch(h, s):  # header says 3, runs hold 2
        h["records"][2]["count"] = 3
        set_section(h, s, 2, "values", b"\1\2\3")
    reject(edited(count_mismatch), "header declares count 3")

    def impossible_raw(h, s):
        set_section(h, s, 2, "positions", b"\1" * 41)  # > 20 bytes per position
    reject(edited(impossible_raw), "impossible for count")

    def empty_frame(h, s):  # a record with no changes carries no frames at all
        h["records"][2]["count"] = 0
        set_section(h, s, 2, "values", b"")
        set_section(h, s, 2, "positions", b"", frame=zstandard.ZstdCompressor().compress(b""))
    reject(edited(empty_frame), "empty section has no frame")


# -------------------------------------------------------------- positions


def varints(*xs) -> bytes:
    return leb128_encode(np.array(xs, dtype=np.uint64)).tobytes()


@pytest.mark.parametrize("raw, reason", [
    (varints(3, 1, 0, 1), "gap 0"),                       # runs not merged
    (varints(3, 1, 1, 0), "length 0"),
    (varints(3, 1, 13, 1), ">= numel 16"),                # position 17
    (varints(15, 2), ">= numel 16"),
    (varints(3, 1, 1), "odd number of varints"),
    (varints(2**63 + 1, 1), "beyond 2**63"),
    (varints(3, 1) + b"\x85", "ends inside a varint"),
    (b"\x80" * 10 + b"\x01" + varints(1), "longer than 10 bytes"),
    (b"\xff" * 9 + b"\x02" + varints(1), "overflows 64 bits"),
    (b"\x83\x00" + varints(1), "non-minimal varint"),
    (varints(3, 1, 1, 1, 1, 1), "3 runs for only 2 positions"),
])
def test_bad_positions(raw, reason):
    def edit(h, s):  # record 2: U8 (4, 4), count 2
        set_section(h, s, 2, "positions", raw)
    reject(edited(edit), reason)


def test_run_ends_wrapping_64_bits_rejected():
    # Each gap/len <= 2**63 passes, but the running end would wrap past 2**64.
    raw = varints(2**63 - 1, 1, 2**63 - 1, 1, 2**63, 1)
    with pytest.raises(PositionsError, match="overflow"):
        decode_runs(raw, 3, 2**63)


def test_positions_never_allocate_the_tensor():
    # 2**40 declared elements, one run of 2**40 positions from a 12-byte section:
    # rejected from the header alone (decoded positions over the limit).
    def edit(h, s):
        r = h["records"][0]
        r["shape"], r["count"] = [2**20, 2**20], 2**40
        set_section(h, s, 0, "positions", varints(0, 2**40))
        h["records"][0]["values"]["raw_length"] = 2 * 2**40
    reject(edited(edit), "max_raw_bytes")


# -------------------------------------------------------------- limits and bombs


def test_limits():
    data = sample()
    reject(data, "max_payload_bytes", limits=DecodeLimits(max_payload_bytes=len(data) - 1))
    reject(data, "max_raw_bytes", limits=DecodeLimits(max_raw_bytes=60))
    reject(data, "max_records", limits=DecodeLimits(max_records=2))
    reject(data, "max_header_bytes", limits=DecodeLimits(max_header_bytes=100))
    reject(data, "max_total_raw_bytes", limits=DecodeLimits(max_total_raw_bytes=100))
    decode(data, limits=DecodeLimits(max_payload_bytes=len(data), max_records=3))


def test_decompression_bomb_frame_larger_than_declared():
    bomb = zc(b"\0" * (1 << 24))  # 16 MiB of zeros in a few hundred bytes
    def edit(h, s):  # header claims 12 raw bytes (6 BF16 values)
        s[0]["values"] = bomb
    reject(edited(edit), "decompression bomb")


def test_frame_without_content_size_is_refused():
    def edit(h, s):
        s[0]["values"] = zc(b"\0" * (1 << 20), write_content_size=False)
    reject(edited(edit), "zstd frame declares")


def test_frame_smaller_or_garbled():
    def lie(h, s):  # frame content size 12, but the frame holds 10 bytes
        frame = bytearray(zc(b"\1" * 12))
        s[0]["values"] = bytes(frame[:-3])
    reject(edited(lie), "zstd decompression failed")

    def not_zstd(h, s):
        s[0]["values"] = b"\x50\x2a\x4d\x18" + struct.pack("<I", 4) + b"abcd"  # skippable
    reject(edited(not_zstd), "not a zstd frame")

    def two_frames(h, s):
        s[0]["values"] = zc(b"\1" * 12) + zc(b"\2" * 12)
    reject(edited(two_frames), "unused data")


# -------------------------------------------------------------- catalog, versions, duplicates


def test_catalog_checks():
    data = sample()
    cat = {"a.weight": ("BF16", (8, 16)), "b.bias": ("F32", (16,)), "c.scale": ("U8", (4, 4))}
    decode(data, catalog=cat)
    reject(data, "unknown tensor name 'c.scale'", catalog={k: cat[k] for k in ("a.weight", "b.bias")})
    reject(data, "dtype mismatch", catalog={**cat, "b.bias": ("BF16", (16,))})
    reject(data, "shape mismatch", catalog={**cat, "a.weight": ("BF16", (16, 8))})


def test_expected_versions():
    data = sample()
    decode(data, expected=Expected("xfer-7", 6, 7))
    decode(data, expected=Expected(base_version=6))
    e = reject(data, "transfer id mismatch", expected=Expected(transfer_id="xfer-8"))
    assert e.payload_id == "rank3-0"
    reject(data, "stale version: base_version 6, expected 7", expected=Expected(base_version=7))
    reject(data, "stale version: target_version", expected=Expected(target_version=8))


def test_duplicate_names():
    def overlap(h, s):
        h["records"][2]["name"] = "a.weight"
        h["records"][2]["shape"] = [8, 16]
        h["records"][2]["dtype"] = "BF16"
        h["records"][2]["values"]["width"] = 2
        set_section(h, s, 2, "values", b"\1\2\3\4")  # positions 3, 4; a.weight has neither
    decode(edited(overlap))
    def overlap2(h, s):
        overlap(h, s)
        set_section(h, s, 2, "positions", varints(1, 2))  # positions 1, 2: overlap
    reject(edited(overlap2), "overlapping positions")
    def different_shape(h, s):
        h["records"][2]["name"] = "a.weight"
    reject(edited(different_shape), "different dtype/shape")


# -------------------------------------------------------------- encode validation


@pytest.mark.parametrize("make, msg", [
    (lambda: rec("w", "F32", (10,), [3, 2]), "strictly increasing"),
    (lambda: rec("w", "F32", (10,), [2, 2]), "strictly increasing"),
    (lambda: rec("w", "F32", (10,), [10]), ">= numel"),
    (lambda: Record("w", "F32", (10,), Op.XOR, np.array([-1]), np.zeros(1, "<u4")), "negative"),
    (lambda: Record("w", "F32", (10,), Op.XOR, np.array([1.0]), np.zeros(1, "<u4")), "integers"),
    (lambda: Record("w", "F32", (10,), Op.XOR, np.array([1, 2], np.uint64),
                    np.zeros(1, "<u4")), "1 values for 2"),
    (lambda: Record("w", "F32", (10,), Op.XOR, np.array([1], np.uint64),
                    np.zeros(1, "<u2")), "value width"),
    (lambda: Record("w", "F9", (10,), Op.XOR, np.array([1], np.uint64),
                    np.zeros(1, "<u2")), "unknown dtype"),
    (lambda: Record("w", "F32", (10,), "mul", np.array([1], np.uint64),
                    np.zeros(1, "<u4")), "mul"),
    (lambda: rec("w", "F32", (2**32, 2**32), [1]), "2**63"),
])
def test_encode_rejects_invalid_records(make, msg):
    with pytest.raises(ValueError, match=msg.replace("*", r"\*")):
        encode(payload(make()))


def _big(positions):
    """A record large enough to be coded as gaps_rans in one pass with its values."""
    pos = np.asarray(positions, np.uint64)
    return Record("w", "BF16", (1 << 20,), Op.XOR, pos, np.ones(pos.size, "<u2"))


@pytest.mark.parametrize("edit, msg", [
    (lambda p: p.__setitem__(3000, p[2999]), "strictly increasing"),           # a repeat
    (lambda p: p.__setitem__(slice(100, 102), p[100:102][::-1]), "strictly increasing"),  # a swap
    (lambda p: p.__setitem__(0, np.uint64(1 << 63)), "strictly increasing"),  # >= 2**63: negative as int64
    (lambda p: p.__setitem__(-1, np.uint64(1 << 20)), ">= numel"),
])
def test_encode_rejects_invalid_large_records(edit, msg):
    # Large records are checked by the gaps split itself (no separate pass): same errors.
    pos = np.arange(0, 3 * 5000, 3, dtype=np.uint64)
    encode(payload(_big(pos)))
    edit(pos)
    with pytest.raises(ValueError, match=msg):
        encode(payload(_big(pos)))


@pytest.mark.parametrize("size", [100, 5000])  # checked before the split, and by it
@pytest.mark.parametrize("edit, msg", [
    (lambda p: p.__setitem__(70, p[69]), "strictly increasing"),
    (lambda p: p.__setitem__(0, np.uint32((1 << 32) - 1)), "strictly increasing"),  # not negative as int32
    (lambda p: p.__setitem__(-1, np.uint32(1 << 20)), ">= numel"),
])
def test_encode_rejects_invalid_uint32_positions(size, edit, msg):
    def record(p):
        return Record("w", "BF16", (1 << 20,), Op.XOR, p, np.ones(p.size, "<u2"))

    pos = np.arange(0, 3 * size, 3, dtype=np.uint32)
    assert encode(payload(record(pos))) == encode(payload(record(pos.astype(np.uint64))))
    edit(pos)
    with pytest.raises(ValueError, match=msg):
        encode(payload(record(pos)))


def test_encode_rejects_bad_header_and_overlap():
    with pytest.raises(ValueError, match="target_version"):
        encode(payload(header=PayloadHeader("t", 3, 2, "p", "p-0")))
    with pytest.raises(ValueError, match="an anchor"):
        encode(payload(rec("w", "F32", (10,), [1]), header=PayloadHeader("t", 3, 3, "p", "p-0")))
    encode(payload(rec("w", "F32", (10,), [1], op=Op.OVERWRITE), header=PayloadHeader("t", 3, 3, "p", "p-0")))
    with pytest.raises(ValueError, match="overlapping"):
        encode(payload(rec("w", "F32", (10,), [1, 2]), rec("w", "F32", (10,), [2, 3])))


def test_peek_header_checks_framing():
    assert peek_header(sample()) == HDR
    with pytest.raises(PayloadRejected, match="bad magic"):
        peek_header(b"NOPE" + sample()[4:])
    with pytest.raises(PayloadRejected, match="unsupported format version"):
        peek_header(edited(lambda h, s: None, version=2))
    with pytest.raises(PayloadRejected, match="truncated"):
        peek_header(sample()[:20])


# -------------------------------------------------------------- fuzz


def test_fuzz_bit_flips_and_truncations_only_reject():
    """Random damage must only ever raise PayloadRejected (or decode, once resealed)."""
    rng = np.random.default_rng(1234)
    data = encode(payload(
        rec("a", "BF16", (4, 64), np.flatnonzero(np.random.default_rng(1).random(256) < 0.2)),
        rec("b", "I64", (2**40,), [5, 6, 7, 2**39]),
        rec("c", "BOOL", (9,), np.arange(9)),
        rec("d", "F8_E4M3", (0,), []),
    ))
    hlen = struct.unpack_from("<I", data, 8)[0]
    body_start, body_end = FRAME_HEAD_BYTES + hlen, len(data) - CHECKSUM_BYTES
    accepted = 0
    for i in range(3000):
        buf = bytearray(data)
        kind = i % 3
        if kind == 0:  # raw damage: must be caught (checksum at the latest)
            for _ in range(rng.integers(1, 4)):
                j = int(rng.integers(0, len(buf)))
                buf[j] ^= 1 << int(rng.integers(0, 8))
            if rng.random() < 0.3:
                buf = buf[: int(rng.integers(0, len(buf)))]
            with pytest.raises(PayloadRejected) as ei:
                decode(bytes(buf))
            assert not ei.value.reason.startswith("malformed payload ("), ei.value.reason
            continue
        # Resealed damage (an attacker who recomputes the unkeyed checksum): every
        # parser path below the checksum gets hit; anything but PayloadRejected fails.
        lo, hi = (FRAME_HEAD_BYTES, body_start) if kind == 1 else (body_start, body_end)
        for _ in range(rng.integers(1, 3)):
            j = int(rng.integers(lo, hi))
            buf[j] ^= 1 << int(rng.integers(0, 8))
        core = bytes(buf[: len(data) - CHECKSUM_BYTES])
        try:
            decode(core + checksum(core))
            accepted += 1
        except PayloadRejected as e:
            # Every reason is a named check, never the catch-all for an internal error.
            assert not e.reason.startswith("malformed payload ("), e.reason
    assert accepted < 2000  # most resealed damage is still caught structurally


# -------------------------------------------------------------- size report


def test_report_compression_1pct_bf16_ulp(capsys):
    """Not an assertion on speed: prints bytes per changed element for a realistic case."""
    n = 10_000_000
    rng = np.random.default_rng(0)
    pos = np.sort(rng.choice(n, n // 100, replace=False)).astype(np.uint64)
    # Old BF16 bits of weights ~N(0, 0.02); new = old +/- 1 ULP on the magnitude.
    old = (rng.normal(0, 0.02, pos.size).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    step = np.where(rng.random(pos.size) < 0.5, 1, -1).astype(np.int32)
    new = (old.astype(np.int32) + step).astype(np.uint16)
    lines = []
    for op, vals in [(Op.XOR, old ^ new), (Op.ADD, (new - old).astype(np.uint16))]:
        p = payload(rec("model.embed_tokens.weight", "BF16", (n,), pos, vals, op=op))
        data = encode(p)
        assert_same(p, decode(data))
        _, h, _ = split(data)
        r = h["records"][0]
        raw = pos.size * (8 + 2)
        lines.append(
            f"[codec report] 1% of {n:,} BF16, +/-1 ULP {op.value}: {len(data):,} B "
            f"= {len(data) / pos.size:.3f} B/changed elt (sections {r['positions']['encoding']} "
            f"{r['positions']['length'] / pos.size:.3f}, {r['values']['encoding']} "
            f"{r['values']['length'] / pos.size:.3f}); "
            f"raw u64+u16 {raw:,} B ({raw / len(data):.1f}x); dense {2 * n:,} B ({2 * n / len(data):.0f}x)")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# -------------------------------------------------------------- entropy-coded encodings


def ulp_record(name, n, rate, op=Op.XOR, seed=0, dtype="BF16"):
    rng = np.random.default_rng(seed)
    dt = dtypes.from_name(dtype)
    pos = np.flatnonzero(rng.random(n) < rate).astype(np.uint64)
    if dt.itemsize == 2:
        old = (rng.normal(0, 0.02, pos.size).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        new = (old.astype(np.int32) + np.where(rng.random(pos.size) < 0.5, 1, -1)).astype(np.uint16)
        vals = {Op.XOR: old ^ new, Op.ADD: (new - old).astype(np.uint16), Op.OVERWRITE: new}[op]
    else:
        vals = rng.integers(1, 7, pos.size).astype(dt.bits_numpy)
    return Record(name, dtype, (n,), op, pos, vals.astype(dt.bits_numpy))


def encodings(data):
    _, h, _ = split(data)
    return [(r["positions"]["encoding"], r["values"]["encoding"]) for r in h["records"]]



def test_large_sparse_record_uses_gaps_and_symbols(monkeypatch):
    p = payload(ulp_record("w", 200_000, 0.01), ulp_record("v", 200_000, 0.03, op=Op.ADD, seed=1))
    data = encode(p)
    # the first has fewer changes than _PAIR_MIN (2000): two streams; the second one joint stream
    assert encodings(data) == [("gaps_rans", "symbols_rans"), ("gaps_joint", "symbols_joint")]
    assert_same(p, decode(data))
    assert len(data) < 1.2 * sum(len(r) for r in p.records) + 1000  # ~1 byte per change, not 10
    monkeypatch.setattr(codec, "encode_joint", lambda *args: None)
    two = encode(p)  # two streams a record (both coded in one pass)
    assert encodings(two) == [("gaps_rans", "symbols_rans"), ("gaps_rans", "symbols_rans")]
    assert_same(p, decode(two))
    assert len(two) * 0.995 < len(data) < len(two) * 1.005  # the joint model's rounding only


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [Op.XOR, Op.ADD])
def test_dense_roundtrip_drops_zeros(dtype, op):
    rng = np.random.default_rng(3)
    dt = dtypes.from_name(dtype)
    n = 5000
    pos = np.flatnonzero(rng.random(n) < 0.4).astype(np.uint64)
    vals = rng.integers(1, 1 << min(8 * dt.itemsize - 1, 20), pos.size).astype(dt.bits_numpy)
    p = payload(Record("d", dtype, (n,), op, pos, vals))
    for mode in ("always", "auto"):
        data = encode(p, dense=mode)
        if mode == "always":
            assert encodings(data)[0][0] == "dense"
        out = decode(data)
        assert_same(p, out)
        assert out.records[0].values.flags.writeable


def test_dense_never_for_overwrite_and_rejected_on_decode():
    rec_ = ulp_record("w", 4000, 0.5, op=Op.OVERWRITE)
    assert encodings(encode(payload(rec_), dense="always"))[0][0] != "dense"
    p = payload(ulp_record("w", 4000, 0.5))
    data = encode(p, dense="always")

    def to_overwrite(h, s):
        h["records"][0]["op"] = "overwrite"
    reject(edited(to_overwrite, data), "needs op xor or add")

    def wrong_count(h, s):
        h["records"][0]["count"] -= 1
    reject(edited(wrong_count, data), "dense values hold")
    with pytest.raises(ValueError, match="dense must be"):
        encode(p, dense="sometimes")


@pytest.mark.parametrize("positions", [[0], [9_999], [0, 9_999], list(range(10_000))])
def test_edge_positions_roundtrip(positions):
    for dtype in ("BF16", "F32", "U8"):
        roundtrip(payload(rec("e", dtype, (10_000,), positions)))


def test_gaps_beyond_2_32_and_2_62():
    rng = np.random.default_rng(5)
    pos = np.unique(np.concatenate([rng.integers(0, 2**33, 500), rng.integers(2**62, 2**63 - 1, 100),
                                    [2**63 - 1]]).astype(np.uint64))
    data = encode(payload(rec("huge", "I64", (2**31, 2**32), pos)))
    assert encodings(data)[0][0] == "gaps_rans"
    np.testing.assert_array_equal(decode(data).records[0].positions, pos)
    raw, _ = encode_gaps_rans(pos)
    np.testing.assert_array_equal(decode_gaps_rans(raw, pos.size, 2**63), pos)
    with pytest.raises(PositionsError):
        decode_gaps_rans(raw, pos.size, 2**62)  # past numel


@pytest.mark.parametrize("part, old, gone", [("positions", "gaps_rans", "gaps"),
                                             ("values", "symbols_rans", "symbols")])
def test_v2_constriction_encodings_are_unknown(part, old, gone):
    """v2's `gaps` / `symbols` (constriction-coded) are not part of v5 or v6: a payload naming
    them is rejected like any unknown encoding, by name, from the header alone."""
    data = encode(payload(ulp_record("w", 100_000, 0.02)))
    assert encodings(data) == [("gaps_rans", "symbols_rans")]

    def rename(h, s):  # the section itself stays a valid gaps_rans / symbols_rans section
        assert h["records"][0][part]["encoding"] == old
        h["records"][0][part]["encoding"] = gone
    bad = edited(rename, data)
    kind = "position" if part == "positions" else "value"
    e = reject(bad, f"unknown {kind} encoding '{gone}'")
    assert e.payload_id == "rank3-0"
    with pytest.raises(PayloadRejected, match=f"unknown {kind} encoding '{gone}'"):
        peek_header(bad)


@pytest.mark.parametrize("dtype", ["BF16", "F16", "I8", "F8_E4M3"])
def test_joint_records_of_narrow_values_decode_to_their_values(dtype):
    """A joint record without escaped values is decoded straight to its values (the joint
    decoder's table holds them, joint.decode_joint): the same values, in the dtype's bits,
    for 16- and 8-bit dtypes alike."""
    rng = np.random.default_rng(4)
    dt = dtypes.from_name(dtype)
    n, numel = 6000, 200_000
    pos = np.sort(rng.choice(numel, n, replace=False)).astype(np.uint64)
    top = np.iinfo(dt.bits_numpy).max
    vals = rng.choice(np.array([1, 2, top], dt.bits_numpy), n, p=[0.6, 0.1, 0.3])
    p = payload(Record("w", dtype, (numel,), Op.ADD, pos, vals))
    data = encode(p, version=5)
    assert encodings(data) == [("gaps_joint", "symbols_joint")]
    assert_same(p, decode(data))


def test_value_symbols_escape_and_wide_alphabets(monkeypatch):
    rng = np.random.default_rng(9)
    n = 40_000
    common = rng.integers(1, 50, n)
    rare = rng.integers(1, 2**16, n)
    vals = np.where(rng.random(n) < 0.97, common, rare).astype(np.uint16)  # > VALUE_ALPHABET distinct
    p = payload(Record("s", "BF16", (2 * n,), Op.XOR, np.arange(n, dtype=np.uint64) * 2, vals))
    for joint, coded in ((True, "symbols_joint"), (False, "symbols_rans")):
        if not joint:
            monkeypatch.setattr(codec, "encode_joint", lambda *args: None)
        data = encode(p)
        assert encodings(data)[0][1] == coded
        assert_same(p, decode(data))
    wide = Record("f", "F64", (n,), Op.XOR, np.arange(n, dtype=np.uint64),
                  rng.integers(1, 300, n).astype(np.uint64) << np.uint64(40))
    roundtrip(payload(wide))


def _resealed_damage(data, trials, seed):
    rng = np.random.default_rng(seed)
    _, header, secs = split(data)
    accepted = 0
    for i in range(trials):
        # Damage the *raw* sections (stored, or decompressed and recompressed), reseal:
        # exercises the gaps_rans / symbols_rans parsers themselves, not just zstd.
        h = json.loads(json.dumps(header))
        s = [dict(x) for x in secs]
        ri = int(rng.integers(0, len(s)))
        part = "positions" if (s[ri]["positions"] is not None and rng.random() < 0.5) else "values"
        raw = bytearray(raw_of(h["records"][ri][part], s[ri][part]))
        kind = i % 3
        if kind == 0 and raw:
            for _ in range(int(rng.integers(1, 4))):
                j = int(rng.integers(0, len(raw)))
                raw[j] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:
            raw = raw[: int(rng.integers(0, len(raw)))]
        else:
            raw += bytes(rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8))
        set_section(h, s, ri, part, bytes(raw))
        try:
            decode(rejoin(h, s))
            accepted += 1
        except PayloadRejected as e:
            assert not e.reason.startswith("malformed payload ("), e.reason
    return accepted


def test_fuzz_entropy_coded_sections_only_reject():
    data = encode(payload(ulp_record("a", 20_000, 0.02), ulp_record("b", 20_000, 0.4, op=Op.ADD, seed=2),
                          ulp_record("c", 3000, 0.01, op=Op.OVERWRITE, seed=4)))
    assert {"gaps_rans", "symbols_rans"} <= {e for pair in encodings(data) for e in pair}
    accepted = _resealed_damage(data, 600, 77)
    assert accepted < 60  # nearly every damaged section is caught structurally


def test_symbol_stream_limits_checked_before_allocation():
    p = payload(ulp_record("w", 100_000, 0.02))
    data = encode(p)

    def huge_count(h, s):  # claims 2**40 changes: refused from the header
        h["records"][0]["count"] = 2**40
        h["records"][0]["shape"] = [2**41]
    reject(edited(huge_count, data), "max_raw_bytes")

    def bad_alphabet(h, s):  # a rANS stream declaring a huge alphabet
        raw = leb128_encode(np.array([1, 0], np.uint64)).tobytes() + b"\1\0" + varints(10**9) + b"\0" * 8
        set_section(h, s, 0, "values", raw)
    reject(edited(bad_alphabet, data), "out of range")

    def words_past_end(h, s):  # the rANS word count runs past the section
        raw = bytearray(raw_of(h["records"][0]["positions"], s[0]["positions"]))
        raw[1:] = bytes([200]) + raw[2:]  # alphabet size byte -> 200 counts: sums no longer match
        set_section(h, s, 0, "positions", bytes(raw))
    reject(edited(words_past_end, data), "positions")


# -------------------------------------------------------------- stored sections, format versions


def rans_payload(key=None, version=FORMAT_VERSION) -> tuple[Payload, bytes]:
    """A rANS-coded record (stored sections; one joint stream) beside sample()'s runs /
    planes / all records."""
    p = payload(ulp_record("big", 200_000, 0.03), *decode(sample()).records)
    return p, encode(p, key=key, version=version)


@pytest.mark.parametrize("joint, coded", [(True, ("gaps_joint", "symbols_joint")),
                                          (False, ("gaps_rans", "symbols_rans"))])
@pytest.mark.parametrize("version", [5, 6])
def test_rans_sections_are_stored_and_the_others_compressed(version, joint, coded, monkeypatch):
    p, _ = rans_payload()
    if not joint:
        monkeypatch.setattr(codec, "encode_joint", lambda *args: None)
    data = encode(p, version=version)
    assert struct.unpack_from("<H", data, 4)[0] == version and FORMAT_VERSION == 5
    _, h, secs = split(data)
    big, a, b, c = h["records"]
    for part in ("positions", "values"):
        assert big[part]["stored"] is True and big[part]["length"] == big[part]["raw_length"]
        assert not secs[0][part].startswith(b"\x28\xb5\x2f\xfd")  # raw bytes, no zstd frame
    assert (big["positions"]["encoding"], big["values"]["encoding"]) == coded
    for r, s in zip((a, b, c), secs[1:]):  # runs / planes: one zstd frame each, no "stored" field
        for part in ("positions", "values"):
            assert "stored" not in r[part]
            if s[part] is not None:
                assert s[part].startswith(b"\x28\xb5\x2f\xfd")
    assert_same(p, decode(data))
    assert peek_header(data) == HDR


def _stored_big(edit):
    """rans_payload() with `edit(positions section dict of the stored record)` applied, resealed."""
    _, data = rans_payload()

    def apply(h, s):
        edit(h["records"][0]["positions"])
    return edited(apply, data)


@pytest.mark.parametrize("edit, reason", [
    (lambda m: m.update(stored=False), "stored: expected true (a zstd section omits the field), got False"),
    (lambda m: m.update(stored=1), "stored: expected true"),
    (lambda m: m.update(stored="true"), "stored: expected true"),
    (lambda m: m.update(stored=None), "stored: expected true"),
    (lambda m: m.update(raw_length=m["raw_length"] + 1), "stored section of length"),
    (lambda m: m.update(raw_length=m["raw_length"] - 1), "stored section of length"),
    (lambda m: m.pop("stored"), "not a zstd frame"),  # a raw section the header calls a frame
])
def test_stored_section_rules(edit, reason):
    reject(_stored_big(edit), reason)


def test_stored_section_rules_need_a_section():
    def on_all(h, s):  # record 2 ("b.bias") is "all": it has no section to store
        h["records"][2]["positions"]["stored"] = True
    _, data = rans_payload()
    reject(edited(on_all, data), "unknown field(s) ['stored']")

    def on_empty(h, s):  # a record without changes has empty sections: nothing to store
        h["records"][0]["values"]["stored"] = True
    reject(edited(on_empty, encode(payload(rec("z", "F32", (10,), [])))), "an empty section has no bytes to store")

    # The key may appear once, like any other.
    _, data = rans_payload()
    _, _, flags, hlen = struct.unpack_from("<4sHHI", data)
    hbytes = header_json(memoryview(data), flags, hlen, DecodeLimits())
    hbytes = hbytes.replace(b'"stored":true', b'"stored":true,"stored":true', 1)
    reject(assemble(hbytes, data[FRAME_HEAD_BYTES + hlen:-CHECKSUM_BYTES]), "duplicate key")


def test_stored_sections_keep_the_limits():
    _, data = rans_payload()
    _, h, _ = split(data)
    biggest = max(r[part]["raw_length"] for r in h["records"] for part in ("positions", "values")
                  if "raw_length" in r[part])
    reject(data, "max_raw_bytes", limits=DecodeLimits(max_raw_bytes=biggest - 1))


def test_stored_flag_is_allowed_on_any_encoding():
    """Decision: "stored" belongs to the section, not to the encoding. The encoder stores only
    the rANS encodings (zstd cannot shrink them), but a runs / planes section stored raw is as
    well defined, and each section's parser checks its raw bytes either way, so it is accepted."""
    def store_everything(h, s):
        for i, r in enumerate(h["records"]):
            for part in ("positions", "values"):
                if s[i][part]:
                    raw = raw_of(r[part], s[i][part])
                    r[part]["stored"] = True
                    set_section(h, s, i, part, raw)
    data = edited(store_everything)
    assert data.count(b'"stored":true') == 5  # a.weight runs + planes, b.bias planes, c.scale runs + planes
    assert_same(decode(sample()), decode(data))

    def bad_runs(h, s):  # stored or not, the runs parser sees the same bytes
        store_everything(h, s)
        set_section(h, s, 2, "positions", varints(3, 1, 0, 1))
    reject(edited(bad_runs), "gap 0")


def test_decoding_stored_sections_never_aliases_or_writes_the_input():
    p, data = rans_payload()
    buf = bytearray(data)
    out = decode(buf)
    assert bytes(buf) == data
    buf[:] = bytes(len(buf))  # the caller reuses its buffer: the decoded records must not change
    assert_same(p, out)
    for r in out.records:
        assert r.positions.flags.writeable and r.values.flags.writeable


@pytest.mark.parametrize("number", [3, 4])
@pytest.mark.parametrize("key", [None, KEY])
def test_earlier_format_versions_are_refused(number, key):
    """Only the host format (5) and the device format (6) are read: a payload that says 3 or 4,
    its checksum and HMAC valid, is refused by its number, naming what is read."""
    _, data = rans_payload(key)
    _, header, secs = split(data[:-HMAC_BYTES] if key else data)
    old = rejoin(header, secs, key=key, version=number)
    why = f"unsupported format version {number} (this decoder reads 5, the host format, and 6, the device format)"
    assert reject(old, why, key=key).payload_id is None
    with pytest.raises(PayloadRejected, match=rf"unsupported format version {number} "):
        peek_header(old)
    with pytest.raises(ValueError, match=rf"version must be 5 or 6 \(the versions this encoder writes\), got {number}"):
        encode(payload(rec("w", "BF16", (8,), [1])), version=number)


def test_joint_encodings_come_together(monkeypatch):
    """gaps_joint / symbols_joint: only as a record's pair."""
    _, data = rans_payload()
    _, h, _ = split(data)
    assert (h["records"][0]["positions"]["encoding"], h["records"][0]["values"]["encoding"]) == \
        ("gaps_joint", "symbols_joint")

    def values_alone(h, s):
        h["records"][0]["positions"]["encoding"] = "gaps_rans"
    reject(edited(values_alone, data), "'gaps_joint' positions and 'symbols_joint' values come together "
                                       "(got 'gaps_rans' / 'symbols_joint')")
    monkeypatch.setattr(codec, "encode_joint", lambda *args: None)
    _, two = rans_payload()

    def positions_alone(h, s):
        h["records"][0]["positions"]["encoding"] = "gaps_joint"
    reject(edited(positions_alone, two), "(got 'gaps_joint' / 'symbols_rans')")

    def swapped(h, s):  # each section parsed as the other kind fails on its own bytes
        h["records"][0]["positions"]["encoding"] = "gaps_rans"
        h["records"][0]["values"]["encoding"] = "symbols_rans"
    with pytest.raises(PayloadRejected, match="record 'big' (positions|values)"):
        decode(edited(swapped, data))


def test_a_long_header_travels_compressed():
    from nemo_dcr.wire.frame import FLAG_HEADER_ZSTD, HEADER_ZSTD_MIN

    many = payload(*[rec(f"layer.{i}.weight", "BF16", (64,), [1, 5, 9], seed=i) for i in range(12)])
    data = encode(many)
    _, _, flags, hlen = struct.unpack_from("<4sHHI", data)
    text = header_json(memoryview(data), flags, hlen, DecodeLimits())
    assert flags & FLAG_HEADER_ZSTD and len(text) >= HEADER_ZSTD_MIN and hlen < len(text) / 2
    assert_same(decode(data), many)
    assert peek_header(data) == HDR
    one = encode(payload(rec("w", "BF16", (64,), [1])))
    assert not struct.unpack_from("<H", one, 6)[0] & FLAG_HEADER_ZSTD  # short headers stay plain
    # A compressed header whose frame declares more than the limit is refused before decompressing.
    reject(data, "max_header_bytes", limits=DecodeLimits(max_header_bytes=len(text) - 1))
    bad = bytearray(data[:-CHECKSUM_BYTES])
    bad[FRAME_HEAD_BYTES:FRAME_HEAD_BYTES + 4] = b"JUNK"
    reject(bytes(bad) + checksum(bytes(bad)), "not a zstd frame")
