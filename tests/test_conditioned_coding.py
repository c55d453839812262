"""Baseline-conditioned records (nemo_dcr.wire.conditioned): exact round trips against the
receiver's own committed bits, chosen only where they pay, and refused - before anything
is decoded - without those bits or against other ones."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_dcr import dtypes
from nemo_dcr.errors import PayloadRejected
from nemo_dcr.mirror import CanonicalMirror
from nemo_dcr.records import BaseSpan, Op, Payload, PayloadHeader, Record
from nemo_dcr.runtimes.store import TensorStoreRuntime
from nemo_dcr.wire import codec, conditioned

HDR = PayloadHeader("t", 0, 1, "p0", "p0-000000")


def held_bits(**arrays):
    """The committed bits a receiver holds, by tensor name."""
    return conditioned.BitsByName(arrays)


def adam_like(n: int, rate_lr: float, seed: int, dtype=torch.bfloat16):
    """Old and new bits of weights moved by about `rate_lr` each (small weights cross more
    rounding boundaries: what conditioning exploits)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.03
    step = torch.randn(n, generator=g).sign() * rate_lr
    old, new = w.to(dtype), (w + step).to(dtype)
    return dtypes.bits_of(old).numpy().view(np.uint16), dtypes.bits_of(new).numpy().view(np.uint16)


def changes(old, new, op):
    pos = np.flatnonzero(old != new)
    vals = (new[pos] - old[pos]).astype(np.uint16) if op is Op.ADD else old[pos] ^ new[pos]
    return pos.astype(np.uint64), vals


def apply(old, op, pos, vals):
    out = old.copy()
    idx = pos.astype(np.int64)
    out[idx] = old[idx] ^ vals if op is Op.XOR else (old[idx] + vals).astype(np.uint16)
    return out


@pytest.mark.parametrize("op", [Op.ADD, Op.XOR])
@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_conditioned_records_round_trip_and_code_smaller(op, dtype):
    n = 1 << 18
    old, new = adam_like(n, 1e-5 if dtype == "BF16" else 1.2e-6, 1, dtypes.from_name(dtype).torch_dtype)
    pos, vals = changes(old, new, op)
    assert 0.005 < pos.size / n < 0.2
    plain = codec.encode(Payload(HDR, [Record("w", dtype, (512, 512), op, pos, vals)]))
    data = codec.encode(Payload(HDR, [Record("w", dtype, (512, 512), op, pos, vals, base=BaseSpan(0, old))]))
    assert '"gaps_conditioned"' in codec.header_text(data) and len(data) < 0.9 * len(plain)
    rec = codec.decode(data, baselines=held_bits(w=old)).records[0]
    assert np.array_equal(apply(old, op, rec.positions, rec.values.view(np.uint16)), new)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(300, 5000), lo=st.integers(0, 200), rate=st.floats(0.05, 1.0), seed=st.integers(0, 2**31),
       op=st.sampled_from([Op.ADD, Op.XOR]))
def test_any_changes_inside_the_universe_decode_exactly(n, lo, rate, seed, op):
    rng = np.random.default_rng(seed)
    # old bits with a few exponents (some classes full, some empty), changes anywhere in the span
    old = (rng.integers(118, 126, n) << 7 | rng.integers(0, 128, n)).astype(np.uint16)
    old[rng.random(n) < 0.1] = 0x3F80  # one class of equal values
    mask = rng.random(n) < rate
    new = old.copy()
    new[mask] = (old[mask] + rng.integers(1, 5, mask.sum()) * rng.choice([-1, 1], mask.sum())).astype(np.uint16)
    pos, vals = changes(old, new, op)
    if pos.size == 0:
        return
    gpos = pos + np.uint64(lo)
    ps, vs = conditioned.encode_conditioned(gpos, vals, dtypes.from_name("BF16"), op, BaseSpan(lo, old))
    got_pos, got_vals = conditioned.decode_conditioned(np.frombuffer(ps, np.uint8), np.frombuffer(vs, np.uint8),
                                                       pos.size, dtypes.from_name("BF16"), op, BaseSpan(lo, old))
    assert np.array_equal(got_pos, gpos) and np.array_equal(got_vals, vals)


def conditioned_payload(n=1 << 16):
    old, new = adam_like(n, 1e-5, 2)
    pos, vals = changes(old, new, Op.ADD)
    data = codec.encode(Payload(HDR, [Record("w", "BF16", (n,), Op.ADD, pos, vals, base=BaseSpan(0, old))]))
    assert '"gaps_conditioned"' in codec.header_text(data)
    return data, old


def test_without_the_baseline_the_record_is_refused_naming_it():
    data, old = conditioned_payload()
    with pytest.raises(PayloadRejected, match=r"committed bits of w\[0:65536\].*does not hold"):
        codec.decode(data)
    with pytest.raises(PayloadRejected, match="does not hold"):
        codec.decode(data, baselines=held_bits())


def test_against_other_bits_the_record_is_refused_before_decoding():
    data, old = conditioned_payload()
    other = old.copy()
    other[12345] ^= 1  # one bit of one element
    with pytest.raises(PayloadRejected, match="baseline digest differs"):
        codec.decode(data, baselines=held_bits(w=other))


def test_a_receiver_holding_other_tensors_skips_the_record():
    data, _ = conditioned_payload()
    assert codec.decode(data, held={"other"}).records == []


def test_the_baseline_field_comes_only_with_conditioned_records():
    data, old = conditioned_payload()
    plain = codec.encode(Payload(HDR, [Record("w", "BF16", (8,), Op.ADD, np.array([1], np.uint64),
                                               np.array([1], np.uint16))]))
    for payload, edit, why in (
            (data, lambda r: r.pop("baseline"), "comes with conditioned records"),
            (plain, lambda r: r.update(baseline={"lo": 0, "n": 8, "xxh3": "0" * 16}), "comes with conditioned"),
            (data, lambda r: r["baseline"].update(n=1 << 20), "must lie in the tensor"),
            (data, lambda r: r["baseline"].update(xxh3="XYZ"), "16 lowercase hex"),
            (data, lambda r: r.update(op="overwrite"), "xor or add")):
        with pytest.raises(PayloadRejected, match=why):
            codec.decode(_edit_header(payload, edit), baselines=held_bits(w=old))


def _edit_header(data: bytes, edit) -> bytes:
    from tests.fuzz_decoder import _seal, _split

    version, flags, header, body = _split(data)
    edit(header["records"][0])
    return _seal(version, flags, header, body, None)


def test_corrupt_sections_are_refused_cleanly():
    data, old = conditioned_payload(1 << 14)
    from tests.fuzz_decoder import _seal, _split

    version, flags, header, body = _split(data)
    rng = np.random.default_rng(0)
    refused = 0
    for _ in range(300):
        b = bytearray(body)
        for i in rng.integers(0, len(b), 3):
            b[i] ^= 1 << int(rng.integers(0, 8))
        try:
            rec = codec.decode(_seal(version, flags, header, bytes(b), None), baselines=held_bits(w=old)).records[0]
        except PayloadRejected:
            refused += 1
            continue
        assert np.all(np.diff(rec.positions.astype(np.int64)) > 0) and rec.positions[-1] < old.size
    assert refused > 250


def test_uniform_changes_keep_the_plain_coding():
    """Synthetic uniform deltas (a change's odds do not depend on the old value): the
    conditioned coding does not pay, the encoder keeps today's bytes."""
    rng = np.random.default_rng(3)
    n = 1 << 18
    old = rng.integers(0, 1 << 16, n).astype(np.uint16)
    pos = np.sort(rng.choice(n, n // 50, replace=False)).astype(np.uint64)
    vals = rng.choice(np.array([1, 0xFFFF], np.uint16), pos.size)
    plain = codec.encode(Payload(HDR, [Record("w", "BF16", (n,), Op.ADD, pos, vals)]))
    data = codec.encode(Payload(HDR, [Record("w", "BF16", (n,), Op.ADD, pos, vals, base=BaseSpan(0, old))]))
    assert data == plain


def test_the_mirror_follows_applies_and_reverts():
    old, new = adam_like(4096, 1e-5, 4)
    mirror = CanonicalMirror({"w": torch.from_numpy(old.view(np.int16)).view(torch.bfloat16)})
    pos, vals = changes(old, new, Op.ADD)
    undo = mirror.apply([Record("w", "BF16", (4096,), Op.ADD, pos, vals)])
    assert np.array_equal(mirror.bits("w", 0, 4096), new)
    mirror.revert(undo)
    assert np.array_equal(mirror.bits("w", 0, 4096), old) and mirror.nbytes == 8192
    assert mirror.bits("w", 0, 5000) is None and mirror.bits("v", 0, 1) is None


def test_a_canonical_store_reads_its_bits_in_place():
    t = torch.randn(64, 32).bfloat16()
    rt = TensorStoreRuntime({"w": t})
    assert np.array_equal(rt.committed_bits("w", 10, 40), dtypes.host_bits(dtypes.bits_of(t).reshape(-1)[10:40]))
    assert rt.committed_bits("nope", 0, 1) is None


def test_header_json_stays_parseable():
    data, _ = conditioned_payload(4096)
    from tests.fuzz_decoder import _split

    header = _split(data)[2]
    assert set(header["records"][0]["baseline"]) == {"lo", "n", "xxh3"}
    json.dumps(header)
