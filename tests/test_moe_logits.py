"""A Megatron MoE model (Qwen3-MoE, Mixtral) under expert parallelism, loaded from an HF
checkpoint through its converter, gives the HF transformers model's logits; and the
Mixtral config maps to (or is refused by) Megatron's TransformerConfig."""

from __future__ import annotations

import pytest

from nemo_dcr.errors import Unsupported
from nemo_dcr.runtimes.megatron.model import transformer_config_from_hf
from tests.support.launch import REPO, TORCHRUN_TIMEOUT_S, torchrun

WORKER = REPO / "tests" / "workers" / "moe_logits_worker.py"


@pytest.mark.multirank
@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2)])
def test_moe_loaded_through_converter_matches_hf(tmp_path, family, tp, ep):
    out = torchrun(tp * ep, WORKER, "--tp", str(tp), "--ep", str(ep), "--family", family,
                   "--checkpoint", str(tmp_path / "ckpt"), ok_marker="[moe_logits] OK")
    assert f"{family} tp={tp} ep={ep}" in out


def mixtral(**kw):
    from transformers import MixtralConfig

    return MixtralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_hidden_layers=2, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                         **kw)


def test_mixtral_config_fields():
    c = transformer_config_from_hf(mixtral(), tp=1, pp=1)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (4, 2, 48)
    # HF: softmax over all experts, top-k, renormalised == Megatron's softmax over the top-k logits.
    assert c.moe_router_pre_softmax is False and c.moe_router_score_function == "softmax"
    assert c.qk_layernorm is False and c.add_qkv_bias is False


@pytest.mark.parametrize("kw,match", [
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ({"sliding_window": 4096}, "sliding_window=4096"),
])
def test_mixtral_refuses_what_it_cannot_build(kw, match):
    with pytest.raises(Unsupported, match=match):
        transformer_config_from_hf(mixtral(**kw), tp=1, pp=1)
