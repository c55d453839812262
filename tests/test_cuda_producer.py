"""The producer on GPU tensors: the diff runs on the device against a device mirror of the
committed baseline (`Baseline.committed_on`), and the records still rebuild the new bits
exactly, through commits, aborts and a file-backed baseline's restart. Runs on machines
with a CUDA GPU; skipped elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr import scan
from nemo_dcr.baseline import Baseline
from nemo_dcr.layout import LocalParam, OwnedRange
from nemo_dcr.placement import AffineMap, Piece
from nemo_dcr.records import Op, TransferInfo
from nemo_dcr.sender import AUTO, Producer
from nemo_dcr.wire import codec
from tests.support.transports import KeepingEnd

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

N = 300_007  # not a multiple of the chunk: the last chunk is short


@pytest.fixture(autouse=True)
def small_device_chunks(monkeypatch):
    monkeypatch.setattr(scan, "_DEVICE_CHUNK", 1)  # chunk_elements rules: three chunks per tensor


def host_bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).cpu().numpy().view(np.uint16).copy()


def change(params, rate: float, rng) -> None:
    for t in params:
        bits = t.view(torch.int16)
        pos = torch.from_numpy(np.flatnonzero(rng.random(bits.numel()) < rate)).to(t.device)
        step = torch.from_numpy(rng.choice(np.array([1, -1], np.int16), pos.numel())).to(t.device)
        bits[pos] += step


def applied(state: list[np.ndarray], payloads: list[bytes]) -> list[np.ndarray]:
    out = [s.copy() for s in state]
    for r in (r for data in payloads for r in codec.decode(data).records):
        flat, pos = out[int(r.name[1:])], r.positions.astype(np.int64)
        op = Op(r.op)
        flat[pos] = flat[pos] ^ r.values if op is Op.XOR else flat[pos] + r.values if op is Op.ADD else r.values
    return out


def producer(params, baseline: Baseline, op, **kw):
    owned, maps, specs = [], {}, {}
    for i, t in enumerate(params):
        owned.append(OwnedRange(LocalParam(f"w{i}", (N,), torch.bfloat16), 0, N, t))
        maps[f"w{i}"] = AffineMap(f"w{i}", N, (Piece(f"c{i}", 0, 1, N, 0, N),))
        specs[f"c{i}"] = ("BF16", (N,))
    end = KeepingEnd()
    return Producer("p0", owned, maps, specs, baseline, end, op=op, chunk_elements=N // 3, **kw), end


@pytest.mark.parametrize("op, wire_version", [(Op.XOR, 5), (AUTO, 5), (Op.XOR, 6), (AUTO, 6)])
def test_gpu_diff_against_a_device_mirror_is_bit_exact_through_commit_and_abort(op, wire_version):
    """wire_version 6: the changes stay on the GPU and are coded there (prefix streams)."""
    rng = np.random.default_rng(0)
    params = [(torch.randn(N, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(2)]
    baseline = Baseline()
    prod, end = producer(params, baseline, op, wire_version=wire_version)
    receiver = [host_bits(t) for t in params]  # what a receiver holds
    version = 0
    for step, commit in enumerate([True, False, True, True]):
        change(params, 0.03, rng)
        end.payloads.clear()
        rep = prod.refit(TransferInfo(f"t{step}", version, version + 1, ("p0",)))
        assert any('"gaps_prefix"' in codec.header_text(d) for d in end.payloads) == (wire_version == 6)
        got = applied(receiver, end.payloads)
        assert all(np.array_equal(g, host_bits(t)) for g, t in zip(got, params)), step
        assert rep.changed_elements == sum(int((g != r).sum()) for g, r in zip(got, receiver))
        if commit:
            baseline.commit()
            receiver, version = got, version + 1
        else:
            baseline.abort()  # the receivers keep the old bits; the next delta is taken against them
        for i, r in enumerate(prod.affine):
            mirror = baseline.committed_on(r.key, params[i].device)
            assert mirror.is_cuda
            assert np.array_equal(mirror.cpu().numpy().view(np.uint16), receiver[i])
            assert np.array_equal(baseline.committed(r.key).numpy().view(np.uint16), receiver[i])


def test_a_restarted_file_backed_baseline_rebuilds_its_mirror_from_disk(tmp_path):
    rng = np.random.default_rng(1)
    params = [(torch.randn(N, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(2)]
    baseline = Baseline(0, tmp_path, fingerprint="f")
    prod, end = producer(params, baseline, Op.XOR)
    baseline.seal()
    receiver = [host_bits(t) for t in params]
    change(params, 0.05, rng)
    prod.refit(TransferInfo("t0", 0, 1, ("p0",)))
    baseline.persist_pending()
    baseline.commit()
    receiver = applied(receiver, end.payloads)
    baseline.wait_committed()
    restarted = Baseline(1, tmp_path, fingerprint="f")
    assert restarted.restored, restarted.restore_note
    prod, end = producer(params, restarted, Op.XOR)
    change(params, 0.05, rng)
    prod.refit(TransferInfo("t1", 1, 2, ("p0",)))
    got = applied(receiver, end.payloads)
    assert all(np.array_equal(g, host_bits(t)) for g, t in zip(got, params))


def test_weights_offloaded_to_the_host_for_a_refit_and_back(tmp_path):
    # A refit diffed on the host (weights offloaded) must not leave a stale device mirror.
    rng = np.random.default_rng(2)
    baseline = Baseline()
    params = [(torch.randn(N, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(2)]
    receiver = [host_bits(t) for t in params]
    for version, device in enumerate(["cuda", "cpu", "cuda"]):
        params = [t.to(device) for t in params]
        prod, end = producer(params, baseline, Op.XOR)
        change(params, 0.03, rng)
        prod.refit(TransferInfo(f"t{version}", version, version + 1, ("p0",)))
        receiver = applied(receiver, end.payloads)
        assert all(np.array_equal(g, host_bits(t)) for g, t in zip(receiver, params)), device
        baseline.commit()
    for i, r in enumerate(prod.affine):
        assert np.array_equal(baseline.committed_on(r.key, params[i].device).cpu().numpy().view(np.uint16),
                              receiver[i])
