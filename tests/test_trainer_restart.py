"""A trainer that dies mid-refit (after its producers sent everything, before the
commit) leaves every baseline at v; restarted from its own checkpoint it refits from
v, and the receiver ends with exactly the restarted trainer's weights. Without the
durable baseline the restarted trainer refuses instead of diverging silently."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from tests.support.launch import REPO, TORCHRUN_TIMEOUT_S, free_port, run, torchrun, worker_env

WORKER = REPO / "tests" / "workers" / "restart_trainer.py"


@pytest.mark.multirank
@pytest.mark.timeout(3 * TORCHRUN_TIMEOUT_S)
def test_a_restarted_trainer_refits_from_the_committed_version(tmp_path):
    ckpt = tmp_path / "ckpt"
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=300, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(ckpt)
    transport_config = json.dumps({"dir": str(tmp_path / "shm"), "timeout_s": 60})
    common = ["--checkpoint", str(ckpt), "--weights", str(tmp_path / "trainer.safetensors"),
              "--transport-config", transport_config, "--state-dir", str(tmp_path / "state"),
              "--baseline-dir", str(tmp_path / "baseline")]
    receiver = subprocess.Popen([sys.executable, "-m", "nemo_dcr.cli", "receive", "--checkpoint", str(ckpt),
                                 "--id", "rx0", "--transport-config", transport_config],
                                cwd=REPO, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    try:
        rc, out = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                       "127.0.0.1", "--master-port", str(free_port()), str(WORKER), "--phase", "crash", *common],
                      TORCHRUN_TIMEOUT_S)
        assert rc != 0 and "rank 0 dies before committing v2" in out, out[-4000:]
        assert "receiver holds the trainer's weights at version 1" in out
        assert sorted(p.name for p in (tmp_path / "state" / "commits").iterdir()) == ["v00000001.json"]
        assert sorted(p.name for p in (tmp_path / "baseline").iterdir()) == ["rank00000-of-2",
                                                                               "rank00001-of-2"]
        refused = torchrun(2, WORKER, "--phase", "refuse", *common, ok_marker="[restart] refused")
        assert "commit log is at version 1" in refused and "assume_committed=True" in refused
        out = torchrun(2, WORKER, "--phase", "restart", *common, ok_marker="[restart] OK")
        assert "receiver holds the trainer's weights at version 2" in out
        rx_out, _ = receiver.communicate(timeout=60)
        assert receiver.returncode == 0 and "shut down at version 2" in rx_out, rx_out[-3000:]
    finally:
        if receiver.poll() is None:
            receiver.kill()
