"""Sequence parallelism on the local (non-Transformer-Engine) spec.

megatron-core 0.16.1's `WrappedTorchNorm` refuses SP, and MoE layers refuse to train at
TP > 1 without it; `build_gpt_model` therefore builds its norms as `LocalRMSNorm`, whose
weights are marked so that `finalize_model_grads` sums their grads over TP. The workers
train Qwen3-MoE (TP=2, EP=2) and dense Qwen3 (TP=2) with SP and the distributed optimizer
(see `tests/workers/sp_train_worker.py`), and compare SP logits with HF's.
"""

from __future__ import annotations

import pytest
import torch

from nemo_dcr.errors import Unsupported
from nemo_dcr.runtimes.megatron.model import LocalRMSNorm, transformer_config_from_hf
from tests.support.launch import REPO, TORCHRUN_TIMEOUT_S, torchrun

WORKER = REPO / "tests" / "workers" / "sp_train_worker.py"
LOGITS = REPO / "tests" / "workers" / "moe_logits_worker.py"


@pytest.mark.multirank
@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("model,ep", [("qwen3_moe", 2), ("qwen3", 1)])
def test_trains_under_tp2_with_sequence_parallel(model, ep):
    out = torchrun(2, WORKER, "--model", model, "--tp", "2", "--ep", str(ep), "--steps", "3",
                   ok_marker="[sp_train] OK")
    assert f"{model} tp=2 ep={ep} sp=True" in out


@pytest.mark.multirank
@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_logits_match_hf_with_sequence_parallel(tmp_path, family):
    out = torchrun(2, LOGITS, "--tp", "2", "--ep", "2", "--sp", "--family", family,
                   "--checkpoint", str(tmp_path / "ckpt"), ok_marker="[moe_logits] OK")
    assert f"{family} tp=2 ep=2 dp=1 sp=True" in out


def qwen3_config(**overrides):
    from transformers import Qwen3Config

    hf = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return transformer_config_from_hf(hf, tp=2, pp=1, **overrides)


@pytest.mark.parametrize("sp", [True, False])
def test_norm_weight_marked_only_where_the_sequence_is_split(sp):
    config = qwen3_config(sequence_parallel=sp)
    hidden = LocalRMSNorm(config, 64, eps=1e-6).to(torch.bfloat16)  # the cast keeps the Parameter object
    qk = LocalRMSNorm(config, 16, eps=1e-6, sequence_split=False)
    assert hidden.weight.sequence_parallel is sp and hidden.weight.dtype == torch.bfloat16
    assert qk.weight.sequence_parallel is False
    x = torch.randn(3, 64)
    assert torch.equal(LocalRMSNorm(config, 64, eps=1e-6)(x), torch.nn.RMSNorm(64, eps=1e-6)(x))


@pytest.mark.parametrize("override,match", [
    ({"normalization": "LayerNorm"}, "normalization 'LayerNorm'"),
    ({"layernorm_zero_centered_gamma": True}, "layernorm_zero_centered_gamma"),
])
def test_local_norm_refuses_what_it_cannot_build(override, match):
    with pytest.raises(Unsupported, match=match):
        LocalRMSNorm(qwen3_config(**override), 64)
