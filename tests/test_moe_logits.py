"""A Megatron Qwen3-MoE model under expert parallelism, loaded from an HF checkpoint
through the qwen3_moe converter, gives the HF transformers model's logits."""

from __future__ import annotations

import pytest

from tests.support.launch import REPO, TORCHRUN_TIMEOUT_S, torchrun

WORKER = REPO / "tests" / "workers" / "moe_logits_worker.py"


@pytest.mark.multirank
@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2)])
def test_moe_loaded_through_converter_matches_hf(tmp_path, tp, ep):
    out = torchrun(tp * ep, WORKER, "--tp", str(tp), "--ep", str(ep), "--checkpoint", str(tmp_path / "ckpt"),
                   ok_marker="[moe_logits] OK")
    assert f"tp={tp} ep={ep}" in out
