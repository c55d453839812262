"""`DCRCheckpointEngine` on both sides of NeMo RL's interface, in one process: one policy
rank (built by NeMo RL's `create_checkpoint_engine`, fed a plain tensor stream) and two
vLLM-side engines whose `receive_weight_batches` runs on threads, as NeMo RL runs them
beside `send_weights`. Each transport is chosen by configuration alone (local shared
memory, a relay tree on loopback, an S3-compatible server); every refit is checked bit
for bit against the trainer's tensors. The Ray / Megatron / vLLM version is
tests/test_nemo_rl_ray.py."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
import torch.distributed as dist

from nemo_dcr.errors import TransferFailed
from nemo_dcr.integrations.nemo_rl.config import ENGINE_PATH
from nemo_dcr.integrations.nemo_rl.transfer_wait import UpdateFailed
from tests.support.faults import FaultyEnd
from tests.support.launch import free_port
from tests.support.s3_server import shared_moto
from tests.support.transports import TRANSPORTS
from tests.support.nemo_rl_import import require_nemo_rl


def transport_section(name: str, tmp_path, monkeypatch) -> dict:
    """The engine block's transport settings for `name`, on this test's own resources
    (S3 credentials from the environment, as the engine's settings require)."""
    receivers = ["rollout0", "rollout1"]
    if name == "local":
        return {"dir": str(tmp_path / "shm"), "timeout_s": 30}
    if name == "relay":
        return {"nodes": [{"id": r, "endpoint": f"tcp://127.0.0.1:{free_port()}"} for r in receivers],
                "coordinator": f"tcp://127.0.0.1:{free_port()}", "timeout_s": 30}
    server = shared_moto()
    config = server.config(server.new_bucket(), poll_s=0.02, timeout_s=30)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", config.pop("access_key"))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", config.pop("secret_key"))
    return config


@pytest.fixture(params=TRANSPORTS)
def engines(request, tmp_path, monkeypatch):
    require_nemo_rl()
    from nemo_rl.utils.checkpoint_engines.base import create_checkpoint_engine

    name = request.param
    kwargs = {"transport": name, name: transport_section(name, tmp_path, monkeypatch), "timeout_s": 30,
              "max_attempts": 1, "max_payload_elements": 4096, "release_after_refit": False}

    def make():
        return create_checkpoint_engine(ENGINE_PATH, bucket_size_bytes=64 << 10, engine_kwargs=dict(kwargs))

    policy, rollouts = make(), [make(), make()]
    metadata = [policy.prepare()] + [r.prepare() for r in rollouts]
    for rank, r in enumerate(rollouts):
        r.init_rollout_process_group(rollout_rank=rank, train_world_size=1, rollout_world_size=2, metadata=metadata)
    policy.init_policy_process_group(worker_rank=0, train_world_size=1, rollout_world_size=2, metadata=metadata)
    yield {"policy": policy, "rollouts": rollouts, "make": make, "metadata": metadata}
    policy.close(shutdown_receivers=True)
    for r in rollouts:
        r.close()
    dist.destroy_process_group()


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(96, 160, generator=g).bfloat16()
               for i in range(3)}
    weights["model.norm.weight"] = torch.ones(96, dtype=torch.bfloat16)
    weights["lm_head.weight"] = torch.randn(50, 96, generator=g).bfloat16()
    return weights


def nudge(weights: dict, names, rate: float = 0.02, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for name in names:
        t = weights[name]
        mask = torch.rand(t.shape, generator=g) < rate
        t[mask] = (t[mask].float() * 1.01 + 1e-3).bfloat16()


def refit(job, weights: dict, served: list[dict]):
    """One NeMo RL sync: send on the policy, receive on every vLLM side; what each vLLM
    side loaded goes into its `served` dict. Returns (metrics or exception, per-side
    loaded names or exception)."""
    results: list = [None] * len(job["rollouts"])

    def receive(i, engine):
        async def drain():
            names = []
            async for batch in engine.receive_weight_batches():
                for name, tensor in batch:
                    assert sum(t.nbytes for _, t in batch) <= 64 << 10 or len(batch) == 1
                    served[i][name] = tensor.clone()
                    names.append(name)
            return names
        try:
            results[i] = asyncio.run(drain())
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results[i] = e

    threads = [threading.Thread(target=receive, args=(i, e)) for i, e in enumerate(job["rollouts"])]
    for t in threads:
        t.start()
    try:
        metrics = asyncio.run(job["policy"].send_weights(iter(list(weights.items()))))
    except Exception as e:  # noqa: BLE001
        metrics = e
    for t in threads:
        t.join(timeout=60)
    return metrics, results


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def test_refits_send_only_changes_and_fail_closed(engines):
    weights, served = model(), [{}, {}]
    m, loaded = refit(engines, weights, served)
    assert m["version"] == 1 and m["resynced_receivers"] == 2  # empty mirrors, dummy vLLM weights: dense
    assert all(sorted(names) == sorted(weights) for names in loaded)
    assert all(same_bits(s, weights) for s in served)

    changed = ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"]
    for step in range(2, 4):
        nudge(weights, changed, seed=step)
        m, loaded = refit(engines, weights, served)
        assert m["version"] == step and m["resynced_receivers"] == 0
        assert 0 < m["changed_elements"] < 0.05 * sum(w.numel() for w in weights.values())
        assert m["wire_bytes"] < m["dense_bytes"] / 10
        assert all(sorted(names) == sorted(changed) for names in loaded)  # only what changed is reloaded
        assert all(same_bits(s, weights) for s in served)

    # a payload corrupted on its way: nothing commits, nothing is loaded, both sides raise
    before = [dict(s) for s in served]
    nudge(weights, changed, seed=9)
    producer = engines["policy"].policy.refit.producer
    producer.end = FaultyEnd(producer.end, {f"{producer.id}-000000": "corrupt"})
    m, loaded = refit(engines, weights, served)
    assert isinstance(m, TransferFailed), m
    assert all(isinstance(r, UpdateFailed) and "aborted" in str(r) for r in loaded), loaded
    assert all(same_bits(s, b) for s, b in zip(served, before))
    producer.end = producer.end.inner

    # the next refit recovers: everything since the last commit, in place
    m, loaded = refit(engines, weights, served)
    assert m["version"] == 4 and m["failed_transfers_before"] == 1
    assert all(same_bits(s, weights) for s in served)


def test_a_restarted_vllm_worker_is_resynced_the_others_are_not(engines):
    weights, served = model(), [{}, {}]
    refit(engines, weights, served)
    engines["rollouts"][1].close()  # vLLM worker 1 restarts: a new engine, an empty mirror
    fresh = engines["make"]()
    fresh.init_rollout_process_group(rollout_rank=1, train_world_size=1, rollout_world_size=2,
                                     metadata=engines["metadata"])
    engines["rollouts"][1] = fresh
    served[1] = {}
    nudge(weights, ["lm_head.weight"])
    m, loaded = refit(engines, weights, served)
    assert m["resynced_receivers"] == 1 and m["version"] == 2
    assert loaded[0] == ["lm_head.weight"] and sorted(loaded[1]) == sorted(weights)
    assert all(same_bits(s, weights) for s in served)


def test_an_export_that_changes_shape_is_refused_whole(engines):
    weights, served = model(), [{}, {}]
    refit(engines, weights, served)
    read = []

    def stream():
        for name, tensor in weights.items():
            read.append(name)
            yield name, (tensor[:10] if name == "lm_head.weight" else tensor)

    with pytest.raises(ValueError, match=r"'lm_head.weight' is BF16 \(10, 96\) now, .*\(50, 96\)"):
        asyncio.run(engines["policy"].send_weights(stream()))
    assert read == list(weights)  # the stream was read to its end (it runs collectives in NeMo RL)


def test_settings_are_checked_when_nemo_rl_builds_the_engine():
    require_nemo_rl()
    from nemo_rl.utils.checkpoint_engines.base import create_checkpoint_engine

    from nemo_dcr.integrations.nemo_rl import ConfigError

    with pytest.raises(ConfigError, match=r"\.transport is required"):
        create_checkpoint_engine(ENGINE_PATH, bucket_size_bytes=1 << 20, engine_kwargs={"release_after_refit": False})
