"""vLLM's own weight-transfer API with `backend: "dcr"` (the `vllm.general_plugins` entry
point of this package), driven by a plain PyTorch trainer through `DCRTrainerEngine`.

Offline: an `LLM` with `weight_transfer_config={"backend": "dcr"}` in the vLLM venv and a
Hugging Face model trained with AdamW in the same process (`tests/workers/
vllm_dcr_offline.py`): three refits, each compared here with a fresh vLLM load of the
trainer's weights (every parameter in loader format, and greedy tokens); then a corrupted,
a forged and a cut-off update, each refused with the engine serving what it served; and
a refit that recovers, compared with a fresh load too.
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


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    require_vllm_venv()
    tmp = tmp_path_factory.mktemp("vllm_dcr")
    # head_dim 64 (vLLM's CPU attention), vocab a multiple of 64 (vLLM's padding)
    ckpt = make_checkpoint(tmp / "v0", family="qwen3", hidden=128, layers=2, heads=2, kv_heads=2, ffn=256,
                           vocab=384, seed=7)
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", DCR_HMAC_KEY="offline-test-key")
    out = tmp / "run"
    proc = subprocess.run([str(VLLM_PYTHON), "-m", "tests.workers.vllm_dcr_offline", "--model", str(ckpt),
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=800)
    (tmp / "offline.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {"result": json.loads(proc.stdout.strip().splitlines()[-1]), "out": out, "tmp": tmp}


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
    for s in steps:  # every committed version equals a fresh vLLM load of the trainer's weights
        export = offline["out"] / f"step{s['step']}"
        served = json.loads((offline["out"] / f"step{s['step']}.json").read_text())
        fresh = VLLMWorker(export, offline["tmp"] / f"fresh{s['step']}.log", "nemo_dcr.runtimes.vllm.DCRWorkerExtension")
        try:
            fresh.read("start-up")
            assert fresh.rpc("dcr_loader_digests", str(export)) == served["digests"], f"step {s['step']}"
            assert [fresh.generate(p) for p in PROMPTS] == served["tokens"], f"step {s['step']}"
        finally:
            fresh.close()
