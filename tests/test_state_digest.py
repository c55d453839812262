"""The whole-state digest (nemo_dcr.digest): kept up to date in O(changes), it must equal
the digest recomputed from scratch, whatever sequence of xor / add / overwrite records
was applied (and reverted), however the elements were split into shares, and through
every path that writes: the compiled scatter on one thread or several, torch's ops,
and loaders whose copies are not one plain copy (the dense paths).

Oracle: `digest.state_digest` of the runtime's state read back, and a plain-Python
evaluation of the definition on small tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_dcr import digest, dtypes
from nemo_dcr.records import Op, Record
from nemo_dcr.runtimes.store import TensorStoreRuntime
from tests.support.records import records_for

_M64 = (1 << 64) - 1


def _fmix(z: int) -> int:
    z ^= z >> 33
    z = (z * 0xFF51AFD7ED558CCD) & _M64
    z ^= z >> 33
    z = (z * 0xC4CEB9FE1A85EC53) & _M64
    return z ^ (z >> 33)


def _reference(name: str, bits: np.ndarray) -> tuple[int, int]:
    """The definition, element by element, in Python integers."""
    t0, t1 = digest.tensor_keys(name)
    s0 = sum(_fmix((t0 + i) & _M64) * int(b) for i, b in enumerate(bits)) & _M64
    s1 = sum(_fmix((t1 + i) & _M64) * int(b) for i, b in enumerate(bits)) & _M64
    return s0, s1


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(5000, generator=g).to(torch.bfloat16),
        "c.scale": torch.randn(7, 9, generator=g),  # FP32
        "d.fp8": torch.randn(33, 16, generator=g).to(torch.float8_e4m3fn),
    }


def _flat_bits(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    out = {}
    for name, t in state.items():
        d = dtypes.from_torch(t.dtype)
        out[name] = dtypes.bits_of(t).reshape(-1).numpy().view(d.bits_numpy).copy()
    return out


def test_the_kernels_compute_the_definition():
    state = _state(0)
    for name, bits in _flat_bits(state).items():
        assert digest.tensor_sums(name, state[name]) == _reference(name, bits), name
    bits = _flat_bits(state)["b.weight"]
    pos = np.array([3, 17, 4000], np.uint64)
    want = _reference("b.weight", np.where(np.isin(np.arange(bits.size), pos), bits, 0))
    assert digest.element_sums("b.weight", pos, bits[pos]) == want


def test_device_arithmetic_matches_the_kernels():
    """The torch path (GPU tensors take it) gives the compiled kernels' sums."""
    rng = np.random.default_rng(1)
    state = _state(1)
    for name, t in state.items():
        bits = dtypes.bits_of(t).reshape(-1)
        t0, t1 = digest.tensor_keys(name)
        assert digest._torch_dense(bits, 5, t0, t1) == digest.tensor_sums(name, t, start=5)
        pos = np.sort(rng.choice(bits.numel(), 20, replace=False)).astype(np.uint64)
        old = bits.numpy().view(dtypes.from_torch(t.dtype).bits_numpy)[pos.astype(np.int64)]
        new = (old + 3).astype(old.dtype)
        for op, vals in ((Op.XOR, old ^ new), (Op.ADD, (new - old).astype(old.dtype)), (Op.OVERWRITE, old)):
            host = digest.change_delta(name, op, pos, new, vals)
            dev = digest.change_delta(name, op, torch.from_numpy(pos.view(np.int64)),
                                      torch.from_numpy(new.view(f"i{new.itemsize}") if new.itemsize > 1 else new),
                                      torch.from_numpy(vals.view(f"i{vals.itemsize}") if vals.itemsize > 1 else vals))
            assert host == dev, (name, op)


def test_shares_add_up_to_the_whole():
    """Any split of a tensor's elements into disjoint shares sums to the tensor's digest."""
    rng = np.random.default_rng(2)
    state = _state(2)
    whole = digest.state_digest(state)
    for name, bits in _flat_bits(state).items():
        owner = rng.integers(0, 3, bits.size)
        shares = [digest.element_sums(name, np.flatnonzero(owner == k).astype(np.uint64), bits[owner == k])
                  for k in range(3)]
        assert digest.add_hex(digest.to_hex(s) for s in shares) == digest.to_hex(whole.tensors[name])


def test_a_single_flipped_bit_changes_the_digest():
    state = _state(3)
    before = digest.state_digest(state).hex()
    for name, t in state.items():
        flipped = {k: v.clone() for k, v in state.items()}
        view = dtypes.bits_of(flipped[name]).reshape(-1)
        view[view.numel() // 2] ^= 1 << 3
        assert digest.state_digest(flipped).hex() != before, name


_op = st.sampled_from([Op.XOR, Op.ADD, Op.OVERWRITE])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), ops=st.lists(_op, min_size=1, max_size=6),
       threads=st.sampled_from([1, 2, 3]), revert=st.booleans(), dense=st.booleans())
def test_kept_digest_equals_the_recomputed_one(seed, ops, threads, revert, dense):
    """Random sequences of records (each op, special bit patterns, shares of the changes
    split over several records), applied on 1-3 threads, some reverted: the digest kept
    from the undo logs equals the one read from the runtime after every step."""
    rng = np.random.default_rng(seed)
    state = _state(seed % 7)
    rt = TensorStoreRuntime({k: v.clone() for k, v in state.items()})
    rt.apply_threads = threads
    if dense:  # torch's ops instead of the compiled scatter (the path GPU storage takes)
        rt._scatters = lambda plan: False
    kept = digest.state_digest(rt.canonical_state())
    logs = []
    for op in ops:
        old = _flat_bits(rt.canonical_state())
        new = {}
        for name, b in old.items():
            mask = rng.random(b.size) < rng.choice([0.001, 0.05, 0.5])
            n = b.copy()
            n[mask] = rng.integers(0, 1 << (8 * b.itemsize), mask.sum(), dtype=np.uint64).astype(b.dtype)
            new[name] = n
        records = []
        for r in records_for(rt.catalog(), old, new, op):  # each tensor's changes as 1-2 records
            cut = int(rng.integers(0, len(r) + 1))
            records += [Record(r.name, r.dtype, r.shape, r.op, r.positions[a:b], r.values[a:b])
                        for a, b in ((0, cut), (cut, len(r))) if b > a]
        log = rt.apply(records)
        assert log.digest is not None
        kept.merge(log.digest)
        logs.append(log)
        assert kept == digest.state_digest(rt.canonical_state())
    if revert:
        for log in reversed(logs):
            rt.revert(log)
            kept.merge(log.digest, -1)
            assert kept == digest.state_digest(rt.canonical_state())
        assert kept == digest.state_digest(state)


def test_dense_overwrite_through_a_transforming_loader_moves_the_digest():
    """A loader that is not one plain copy (here: it writes the tensor in two halves)
    takes the dense paths; the digest moves as the bits do."""

    class Halves(TensorStoreRuntime):
        def _load(self, tensors):
            for name, src in tensors.items():
                dst = self.tensors[name].view(-1)
                flat = src.reshape(-1)
                half = flat.numel() // 2
                with torch.no_grad():
                    dst[:half].copy_(flat[:half])
                    dst[half:].copy_(flat[half:])

    state = _state(4)
    rt = Halves({k: v.clone() for k, v in state.items()})
    kept = digest.state_digest(rt.canonical_state())
    old = _flat_bits(rt.canonical_state())
    new = {k: (v ^ np.asarray(1, v.dtype)) if k != "c.scale" else v for k, v in old.items()}
    for op in (Op.XOR, Op.OVERWRITE):
        log = rt.apply(records_for(rt.catalog(), old, new, op))
        kept.merge(log.digest)
        assert kept == digest.state_digest(rt.canonical_state())
        rt.revert(log)
        kept.merge(log.digest, -1)
        assert kept == digest.state_digest(state)


def test_hex_round_trip_and_refusals():
    d = digest.StateDigest({"x": (1, 2), "y": ((1 << 64) - 1, 5)})
    assert digest.StateDigest.from_json(d.to_json()).tensors == d.tensors
    assert d.hex() == digest.to_hex((0, 7))
    assert digest.StateDigest({"x": (1, 2)}).differing(digest.StateDigest({"x": (1, 3), "z": (0, 1)})) == ["x", "z"]
    with pytest.raises(ValueError, match="32 hex digits"):
        digest.from_hex("abc")
