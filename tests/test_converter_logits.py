"""A Megatron model loaded from an HF checkpoint through the converter matches the
HF transformers model of that checkpoint (bits of the export, and logits)."""

from __future__ import annotations

import pytest

from tests.support.launch import REPO, TORCHRUN_TIMEOUT_S, torchrun

WORKER = REPO / "tests" / "workers" / "converter_logits_worker.py"


@pytest.mark.multirank
@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("tp,pp,model", [(2, 1, "qwen3"), (1, 2, "llama-tied"), (2, 2, "qwen3"), (2, 1, "qwen2")])
def test_loaded_through_converter_matches_hf(tmp_path, tp, pp, model):
    out = torchrun(tp * pp, WORKER, "--tp", str(tp), "--pp", str(pp), "--model", model,
                   "--checkpoint", str(tmp_path / "ckpt"), ok_marker="[converter_logits] OK")
    assert "export bit-exact" in out
