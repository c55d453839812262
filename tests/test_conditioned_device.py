"""The torch decoder of conditioned records' positions (nemo_dcr.wire.conditioned_device)
against the host one (`conditioned.decode_conditioned`): the same positions and values
bit for bit, and on any damaged section or other baseline the same PositionsError with
the same message. Runs on CPU tensors here; on a GPU the same ops run there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr import dtypes
from nemo_dcr.records import BaseSpan, Op
from nemo_dcr.wire import conditioned
from nemo_dcr.wire.conditioned_device import (ClassGaps, decode_conditioned_device, decode_positions_device,
                                              element_classes)
from nemo_dcr.wire.errors import PositionsError

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def adam_like(n: int, k: float, seed: int, dt: str = "BF16", lr: float = 1e-5):
    """Old and new bits of N(0, 0.02) weights after one AdamW-like step lr * u, u ~ N(0, k^2)
    standing in for Adam's m / sqrt(v) (BF16: k 0.05 moves about 2% of the elements)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02
    step = torch.randn(n, generator=g) * (lr * k)
    tdt = dtypes.from_name(dt).torch_dtype
    old, new = w.to(tdt), (w + step).to(tdt)
    return dtypes.bits_of(old).numpy().view(np.uint16), dtypes.bits_of(new).numpy().view(np.uint16)


def random_bits(n: int, rate: float, seed: int):
    """A few exponents (some classes full, some empty, one of equal values), changes of
    +-1..4 anywhere."""
    rng = np.random.default_rng(seed)
    old = (rng.integers(118, 126, n) << 7 | rng.integers(0, 128, n)).astype(np.uint16)
    old[rng.random(n) < 0.1] = 0x3F80
    new = old.copy()
    mask = rng.random(n) < rate
    mask[rng.integers(0, n)] = True
    new[mask] = (old[mask] + rng.integers(1, 5, mask.sum()) * rng.choice([-1, 1], mask.sum())).astype(np.uint16)
    return old, new


def coded(old, new, op: Op, dt: str, lo: int):
    pos = np.flatnonzero(old != new)
    vals = (new[pos] - old[pos]).astype(np.uint16) if op is Op.ADD else old[pos] ^ new[pos]
    gpos = pos.astype(np.uint64) + np.uint64(lo)
    ps, vs = conditioned.encode_conditioned(gpos, vals, dtypes.from_name(dt), op, BaseSpan(lo, old))
    return np.frombuffer(ps, np.uint8), np.frombuffer(vs, np.uint8), gpos, vals


def outcome(fn):
    """(positions, values) as host arrays, or the error's type and message."""
    try:
        pos, vals = fn()
    except PositionsError as e:
        return ("error", type(e), str(e))
    if isinstance(pos, torch.Tensor):
        pos = pos.cpu().numpy().astype(np.uint64)
    return ("ok", pos, vals)


def both(ps, vs, count, dt: str, op: Op, lo: int, old, device="cpu"):
    d = dtypes.from_name(dt)
    host = outcome(lambda: conditioned.decode_conditioned(ps, vs, count, d, op, BaseSpan(lo, old)))
    bits = torch.from_numpy(old.view(np.int16).copy()).to(device)
    dev = outcome(lambda: decode_conditioned_device(ps, vs, count, d, op, lo, bits))
    return host, dev


def same(a, b) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "error":
        return a[1:] == b[1:]
    return np.array_equal(a[1], b[1]) and a[1].dtype == b[1].dtype and np.array_equal(a[2], b[2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", ["BF16", "F16"])
@pytest.mark.parametrize("op", [Op.XOR, Op.ADD])
def test_realistic_records_decode_as_the_host_decodes_them(op, dt, device):
    for k, lo in ((0.05, 0), (0.15, 12345)):
        old, new = adam_like(1 << 17, k, 1, dt, lr=1e-5 if dt == "BF16" else 1e-6)
        ps, vs, pos, vals = coded(old, new, op, dt, lo)
        assert 0.005 < pos.size / old.size < 0.2
        host, dev = both(ps, vs, pos.size, dt, op, lo, old, device)
        assert host[0] == "ok" and np.array_equal(host[1], pos) and np.array_equal(host[2], vals)
        assert same(host, dev)


@pytest.mark.parametrize("op", [Op.XOR, Op.ADD])
def test_random_records_decode_as_the_host_decodes_them(op):
    rng = np.random.default_rng(7)
    for seed in range(30):
        n = int(rng.integers(300, 5000))
        lo = int(rng.integers(0, 200))
        old, new = random_bits(n, float(rng.uniform(0.02, 1.0)), seed)
        ps, vs, pos, vals = coded(old, new, op, "BF16", lo)
        host, dev = both(ps, vs, pos.size, "BF16", op, lo, old)
        assert host[0] == "ok" and np.array_equal(host[1], pos)
        assert same(host, dev), seed


def test_positions_and_classes_on_the_device():
    old, new = random_bits(4000, 0.3, 1)
    ps, vs, pos, vals = coded(old, new, Op.XOR, "BF16", 100)
    dpos, dcls = decode_positions_device(ps, pos.size, dtypes.from_name("BF16"), 100,
                                         torch.from_numpy(old.view(np.int16)))
    assert dpos.dtype == torch.int64 and dcls.dtype == torch.uint8
    assert np.array_equal(dpos.numpy(), pos.astype(np.int64))
    assert np.array_equal(dcls.numpy(), (old[pos.astype(np.int64) - 100] >> 7) & 0xFF)
    # the weights themselves serve as the bits (any 2-byte view)
    w = torch.from_numpy(old.view(np.int16)).view(torch.bfloat16)
    assert torch.equal(element_classes(w, dtypes.from_name("BF16")), dcls.new_tensor(((old >> 7) & 0xFF)))
    with pytest.raises(ValueError, match="2-byte"):
        element_classes(torch.zeros(4, dtype=torch.int32), dtypes.from_name("BF16"))


@pytest.mark.parametrize("dt", ["BF16", "F16"])
def test_a_wrong_baseline_fails_or_decodes_as_the_host_does(dt):
    """Without the codec's digest check: other bits either decode to the same (wrong)
    changes on both, or both raise the same PositionsError."""
    old, new = adam_like(1 << 14, 0.15, 3, dt, lr=1e-5 if dt == "BF16" else 1e-6)
    ps, vs, pos, _ = coded(old, new, Op.ADD, dt, 0)
    rng = np.random.default_rng(0)
    errors = 0
    for trial in range(40):
        other = old.copy()
        if trial == 0:  # every element one class up: the stream's ranks do not fit
            shift = 7 if dt == "BF16" else 10
            other = (other + np.uint16(1 << shift)).astype(np.uint16)
        else:
            idx = rng.integers(0, other.size, int(rng.integers(1, 200)))
            other[idx] = rng.integers(0, 1 << 16, idx.size).astype(np.uint16)
        host, dev = both(ps, vs, pos.size, dt, Op.ADD, 0, other)
        assert same(host, dev), (trial, host[:1], dev[:1], host[-1] if host[0] == "error" else "")
        errors += host[0] == "error"
    assert errors >= 1
    # a universe shorter than the record's: the changes do not fit
    host, dev = both(ps, vs, pos.size, dt, Op.ADD, 0, old[: old.size // 2])
    assert host[0] == "error" and same(host, dev)
    assert "more changes than the universe's elements" in host[2]


def test_malformed_sections_fail_as_the_host_fails():
    old, new = adam_like(1 << 13, 0.15, 5)
    ps, vs, pos, _ = coded(old, new, Op.XOR, "BF16", 0)
    rng = np.random.default_rng(1)
    kinds = {"ok": 0, "error": 0}
    cases = [(ps[:-1], vs, pos.size), (ps, vs[:-1], pos.size), (ps, vs, pos.size + 1), (ps, vs, pos.size - 1),
             (np.concatenate([ps, [0]]).astype(np.uint8), vs, pos.size), (ps[:3], vs, pos.size)]
    for _ in range(150):
        p, v = ps.copy(), vs.copy()
        target = p if rng.random() < 0.8 else v
        for i in rng.integers(0, target.size, int(rng.integers(1, 4))):
            target[i] ^= np.uint8(1 << int(rng.integers(0, 8)))
        cases.append((p, v, pos.size))
    for p, v, count in cases:
        host, dev = both(p, v, count, "BF16", Op.XOR, 0, old)
        assert same(host, dev), (host[0], dev[0], host[-1] if host[0] == "error" else dev[-1])
        kinds[host[0]] += 1
    assert kinds["error"] > 100


def test_class_gaps_read_on_the_host():
    old, new = random_bits(3000, 0.2, 2)
    ps, _, pos, _ = coded(old, new, Op.XOR, "BF16", 0)
    gaps = ClassGaps(ps, pos.size, dtypes.from_name("BF16"))
    cls = (old[pos.astype(np.int64)] >> 7) & 0xFF
    want = []
    for c in np.flatnonzero(gaps.counts):
        members = np.flatnonzero(((old >> 7) & 0xFF) == c)
        want.extend(np.searchsorted(members, pos[cls == c].astype(np.int64)))
    assert np.array_equal(gaps.ranks, want)
    totals = np.bincount((old >> 7) & 0xFF, minlength=256).astype(np.int64)
    assert gaps.status(totals) == pos.size
    with pytest.raises(PositionsError, match="classes hold"):
        ClassGaps(ps, pos.size + 1, dtypes.from_name("BF16"))
