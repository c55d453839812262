"""vLLM's own weight-transfer API with `backend: "dcr"` (the `vllm.general_plugins` entry
point of this package), driven by a plain PyTorch trainer through `DCRTrainerEngine`.

Offline: an `LLM` with `weight_transfer_config={"backend": "dcr"}` in the vLLM venv and a
Hugging Face model trained with AdamW in the same process (`tests/workers/
vllm_dcr_offline.py`): three refits, each compared here with a fresh vLLM load of the
trainer's weights (every parameter in loader format, and greedy tokens); then a corrupted,
a forged and a cut-off update, each refused with the engine serving what it served; and
a refit that recovers, compared with a fresh load too.

Online: `vllm serve`'s launcher with `--weight-transfer-config '{"backend": "dcr"}'` and
two tensor-parallel workers, refit three times by a trainer that reaches it only through
its HTTP RL routes (`tests/workers/vllm_dcr_online.py`), while another client keeps
generating; after each refit every worker's parameters in loader format, the server's
weight checksums (`/weight_checker`) and greedy tokens equal a fresh TP=2 load's.

The fresh loads of a run start together (one vLLM process per version).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from nemo_dcr.cli import make_checkpoint
from tests.support.launch import REPO
from tests.support.vllm_venv import VLLM_PYTHON, VLLMWorker, require_vllm_venv

pytestmark = pytest.mark.timeout(900)

PROMPTS = [[3, 17, 42, 99, 7, 250, 11, 64], [300, 5, 5, 123, 77, 19, 201, 8]]


def run(worker: str, tmp, *args: str, **env) -> dict:
    """A driver in the vLLM venv on a fresh tiny Qwen3 checkpoint; its JSON report."""
    require_vllm_venv()
    # head_dim 64 (vLLM's CPU attention), vocab a multiple of 64 (vLLM's padding)
    ckpt = make_checkpoint(tmp / "v0", family="qwen3", hidden=128, layers=2, heads=2, kv_heads=2, ffn=256,
                           vocab=384, seed=7)
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               DCR_HMAC_KEY="weight-transfer-test-key", **env)
    out = tmp / "run"
    out.mkdir()
    proc = subprocess.run([str(VLLM_PYTHON), "-m", worker, "--model", str(ckpt), "--out", str(out), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=800)
    (tmp / "driver.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {"result": json.loads(proc.stdout.strip().splitlines()[-1]), "out": out, "tmp": tmp}


def fresh_loads(job: dict, steps: list[int], tp: int = 1) -> dict[int, VLLMWorker]:
    """A fresh vLLM load of the trainer's weights after each step, all started at once."""
    workers = {k: VLLMWorker(job["out"] / f"step{k}", job["tmp"] / f"fresh{k}.log",
                             "nemo_dcr.integrations.vllm.worker_extension.DCRWorkerExtension", tp=tp) for k in steps}
    for w in workers.values():
        w.read("start-up")
    return workers


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    return run("tests.workers.vllm_dcr_offline", tmp_path_factory.mktemp("vllm_dcr_offline"),
               VLLM_ENABLE_V1_MULTIPROCESSING="0")


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    return run("tests.workers.vllm_dcr_online", tmp_path_factory.mktemp("vllm_dcr_online"), "--tp", "2")


def test_offline_llm_refits_through_the_dcr_backend(offline):
    steps = offline["result"]["steps"]
    assert [s["version"] for s in steps] == [1, 2, 3, 4]
    for s in steps[:3]:
        assert s["weight_version"] == str(int(s["version"]))  # vLLM's own weight version follows the commits
        assert 0 < s["changed_elements"] < 0.2 * 426880 and s["wire_bytes"] < s["dense_bytes"] / 4
    assert steps[3]["failed_transfers_before"] == 3
    faults = offline["result"]["faults"]
    assert "checksum mismatch" in faults["corrupt"] and "HMAC mismatch" in faults["forge"]
    assert faults["drop"]  # a payload that never arrived: nothing applied, the update timed out
    fresh = fresh_loads(offline, [s["step"] for s in steps])
    try:  # every committed version equals a fresh vLLM load of the trainer's weights
        for k, worker in fresh.items():
            served = json.loads((offline["out"] / f"step{k}.json").read_text())
            assert worker.rpc("dcr_loader_digests", str(offline["out"] / f"step{k}")) == served["digests"], k
            assert [worker.generate(p) for p in PROMPTS] == served["tokens"], k
    finally:
        for worker in fresh.values():
            worker.close()


def test_vllm_serve_refits_over_its_http_routes_while_serving(online):
    """Under TP=2: each worker is its own receiver and ends with a fresh TP=2 load's shard."""
    result = online["result"]
    steps = result["steps"]
    assert [s["version"] for s in steps] == [1, 2, 3]
    assert [s["weight_version"] for s in steps] == ["1", "2", "3"]
    assert all(s["wire_bytes"] < s["dense_bytes"] / 4 for s in steps)
    assert result["requests"] >= 6 and result["failures"] == []  # generation went on throughout
    fresh = fresh_loads(online, [s["step"] for s in steps], tp=2)
    try:
        for k, worker in fresh.items():
            served = json.loads((online["out"] / f"step{k}.json").read_text())
            digests = worker.call(op="rpc", method="dcr_loader_digests", args=[str(online["out"] / f"step{k}")])
            assert len(digests) == 2  # per TP worker, loader format
            for rank, (got, want) in enumerate(zip(served["digests"], digests)):
                assert got == want, (k, rank, sorted(n for n in got.keys() | want.keys() if got.get(n) != want.get(n)))
            checksums = {}
            for part in worker.call(op="rpc", method="compute_weight_checksums"):
                checksums.update(part)
            assert checksums == served["checksums"], k
            assert [worker.generate(p) for p in PROMPTS] == served["tokens"], k
    finally:
        for worker in fresh.values():
            worker.close()


REFUSALS = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from nemo_dcr.integrations.vllm.engine import refusals
out = {}
for name, kw in [("plain", {}), ("pp", {"pipeline_parallel_size": 2}), ("ep", {"enable_expert_parallel": True}),
                 ("fp8", {"quantization": "fp8"})]:
    config = EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=64,
                        **kw).create_engine_config()
    out[name] = refusals(config)
print(json.dumps(out))
"""


def test_what_the_backend_refuses_is_named(tmp_path):
    """vLLM's own engine configs (MoE checkpoint): plain BF16 runs; PP, EP and a quantized
    model are refused, each naming the setting."""
    require_vllm_venv()
    ckpt = make_checkpoint(tmp_path / "moe", family="qwen3_moe", hidden=128, layers=2, heads=2, kv_heads=2,
                           ffn=256, vocab=384, seed=7)
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    proc = subprocess.run([str(VLLM_PYTHON), "-c", REFUSALS, str(ckpt)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["plain"] == []
    assert "pipeline_parallel_size=2" in got["pp"][0]
    assert "enable_expert_parallel" in got["ep"][0]
    assert "quantization='fp8'" in got["fp8"][0]
