"""The plain-PyTorch path under torch DDP: two trainer ranks own half of every
parameter each and refit a receiver process bit-exactly (each rank encoding its payloads
on two threads beside its diff: TrainerRefit(encode_threads=2))."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from tests.support.launch import REPO, TORCHRUN_TIMEOUT_S, torchrun, worker_env

WORKER = REPO / "tests" / "workers" / "ddp_refit_worker.py"


@pytest.mark.multirank
@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 60)
def test_torch_ddp_ranks_refit_a_receiver(tmp_path):
    ckpt = tmp_path / "ckpt"
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=300, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(ckpt)
    transport_config = json.dumps({"dir": str(tmp_path / "shm"), "timeout_s": 120})
    receiver = subprocess.Popen([sys.executable, "-m", "nemo_dcr.cli", "receive", "--checkpoint", str(ckpt),
                                 "--id", "rx0", "--transport-config", transport_config],
                                cwd=REPO, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    try:
        out = torchrun(2, WORKER, "--checkpoint", str(ckpt), "--transport-config", transport_config,
                       "--state-dir", str(tmp_path / "state"), ok_marker="[ddp_refit] OK")
        assert out.count("bit-exact") == 3
        rx_out, _ = receiver.communicate(timeout=60)
        assert receiver.returncode == 0 and "shut down at version 3" in rx_out, rx_out[-3000:]
    finally:
        if receiver.poll() is None:
            receiver.kill()
