"""The Megatron builder refuses every Hugging Face config field it does not model, naming
the field and its value, all problems of a config in one error; the configs it models
pass. Pure CPU, one process: `check_supported` needs no parallel state."""

from __future__ import annotations

import types

import pytest
from transformers import (
    GemmaConfig,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from nemo_dcr.errors import Unsupported
from nemo_dcr.runtimes.megatron.model import build_gpt_model, check_supported, transformer_config_from_hf

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=128, vocab_size=300, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2)


def namespace(config, **changes):
    """``config`` as a plain object (a config transformers did not build), with ``changes``;
    a change to None removes the field."""
    fields = {**config.to_dict(), **changes}
    return types.SimpleNamespace(**{k: v for k, v in fields.items() if v is not None})


def sliding_flag_off(cls):
    # transformers 5 drops the size while use_sliding_window is off; 4.x and raw configs keep it.
    config = cls(**SMALL, use_sliding_window=False, sliding_window=4096)
    config.sliding_window = 4096
    return config


SUPPORTED = {
    "llama": lambda: LlamaConfig(**SMALL),
    "llama-tied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True, rope_theta=50000.0),
    "mistral-no-window": lambda: MistralConfig(**SMALL, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**SMALL),
    "qwen2-window-off": lambda: sliding_flag_off(Qwen2Config),
    "qwen3": lambda: Qwen3Config(**SMALL, head_dim=32),
    "qwen3-window-off": lambda: sliding_flag_off(Qwen3Config),
    "qwen3_moe": lambda: Qwen3MoeConfig(**SMALL, **MOE, num_experts=4, moe_intermediate_size=32),
    "qwen3_moe-window-off": lambda: sliding_flag_off(
        lambda **kw: Qwen3MoeConfig(**kw, **MOE, num_experts=4, moe_intermediate_size=32)),
    "mixtral": lambda: MixtralConfig(**SMALL, **MOE, num_local_experts=4),
    # Training-only settings leave the weights' meaning alone: not refused.
    "llama-dropout": lambda: LlamaConfig(**SMALL, attention_dropout=0.1),
}


@pytest.mark.parametrize("name", SUPPORTED)
def test_supported_configs_pass(name):
    check_supported(SUPPORTED[name]())


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-window-off", "qwen3_moe", "mixtral"])
def test_supported_configs_build_a_transformer_config(name):
    config = transformer_config_from_hf(SUPPORTED[name](), tp=1, pp=1)
    assert config.rotary_interleaved is False and config.add_bias_linear is False


def refused(config) -> str:
    with pytest.raises(Unsupported) as info:
        check_supported(config)
    return str(info.value)


REFUSED = {
    # sliding-window attention, where the model type applies it
    "mistral-window": (lambda: MistralConfig(**SMALL), ["MistralConfig.sliding_window=4096"]),
    "mixtral-window": (lambda: MixtralConfig(**SMALL, **MOE, num_local_experts=4, sliding_window=32),
                       ["MixtralConfig.sliding_window=32"]),
    "qwen2-window-on": (lambda: Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=1),
                        ["Qwen2Config.use_sliding_window=True", "sliding_window=16", "layer_types"]),
    "qwen3-window-on": (lambda: Qwen3Config(**SMALL, use_sliding_window=True, sliding_window=16),
                        ["Qwen3Config.use_sliding_window=True"]),
    # RoPE: partial, scaled, in either field
    "partial-rotary": (lambda: Phi3Config(**SMALL, partial_rotary_factor=0.5),
                       ["Phi3Config.partial_rotary_factor=0.5", "partial rotary"]),
    "partial-rotary-in-rope-parameters": (
        lambda: LlamaConfig(**SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                      "partial_rotary_factor": 0.5}),
        ["LlamaConfig.rope_parameters['partial_rotary_factor']=0.5"]),
    "llama3-rope": (lambda: LlamaConfig(**SMALL, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}), ["LlamaConfig.rope_parameters['rope_type']='llama3'"]),
    "yarn-rope": (lambda: Qwen2Config(**SMALL, rope_parameters={
        "rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4, "original_max_position_embeddings": 32}),
        ["rope_parameters['rope_type']='yarn'"]),
    "rope-scaling-4x": (lambda: namespace(LlamaConfig(**SMALL), rope_parameters=None,
                                          rope_scaling={"type": "linear", "factor": 2.0}),
                        ["SimpleNamespace.rope_scaling['type']='linear'"]),
    # biases, activation
    "llama-biases": (lambda: LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True),
                     ["LlamaConfig.attention_bias=True", "LlamaConfig.mlp_bias=True"]),
    "qwen3-attention-bias": (lambda: Qwen3Config(**SMALL, attention_bias=True),  # biases o_proj too
                             ["Qwen3Config.attention_bias=True", "o_proj"]),
    "gelu": (lambda: LlamaConfig(**SMALL, hidden_act="gelu"), ["LlamaConfig.hidden_act='gelu'"]),
    # model types the builder does not know
    "gemma": (lambda: GemmaConfig(**SMALL), ["GemmaConfig.model_type='gemma'",
                                             "GemmaConfig.hidden_act='gelu_pytorch_tanh'"]),
    "gemma2": (lambda: Gemma2Config(**SMALL), [
        "Gemma2Config.model_type='gemma2'", "hidden_activation='gelu_pytorch_tanh'", "sliding_window=4096",
        "layer_types holds ['sliding_attention']", "attn_logit_softcapping=50.0", "final_logit_softcapping=30.0"]),
    # shapes and the output layer
    "odd-head-dim": (lambda: namespace(Qwen3Config(**SMALL), head_dim=15), ["head_dim=15", "RoPE"]),
    "gqa": (lambda: Qwen3Config(**{**SMALL, "num_key_value_heads": 3}), ["num_key_value_heads=3"]),
    "tie-unset": (lambda: namespace(LlamaConfig(**SMALL), tie_word_embeddings=None),
                  ["SimpleNamespace.tie_word_embeddings=None"]),
    # MoE
    "moe-dense-layers": (lambda: Qwen3MoeConfig(**SMALL, **MOE, num_experts=4, moe_intermediate_size=32,
                                                decoder_sparse_step=2, mlp_only_layers=[0]),
                         ["decoder_sparse_step=2", "mlp_only_layers=[0]"]),
    "moe-no-experts": (lambda: Qwen3MoeConfig(**SMALL, **MOE, num_experts=0, moe_intermediate_size=32),
                       ["Qwen3MoeConfig.num_experts=0"]),
    "mixtral-jitter": (lambda: MixtralConfig(**SMALL, **MOE, num_local_experts=4, router_jitter_noise=0.1),
                       ["MixtralConfig.router_jitter_noise=0.1"]),
}


@pytest.mark.parametrize("name", REFUSED)
def test_refusal_names_the_field_and_value(name):
    make, fields = REFUSED[name]
    message = refused(make())
    for field in fields:
        assert field in message, (field, message)


def test_phi3_config_lists_every_problem_in_one_error():
    """The reported case: a Phi-3 config, accepted before, would have trained another model."""
    config = Phi3Config(**SMALL, sliding_window=32, partial_rotary_factor=0.5, resid_pdrop=0.1, embd_pdrop=0.1,
                        attention_dropout=0.1, original_max_position_embeddings=64)
    message = refused(config)
    problems = [line for line in message.splitlines() if line.startswith("  - ")]
    assert [p.split("=")[0] for p in problems] == [
        "  - Phi3Config.model_type", "  - Phi3Config.partial_rotary_factor", "  - Phi3Config.sliding_window"]
    assert "qkv_proj and gate_up_proj" in message and "3 problem(s)" in message
    # Dropout only acts in training: it does not change what the weights compute.
    assert "pdrop" not in message and "attention_dropout" not in message


def test_every_entry_point_checks_first():
    """transformer_config_from_hf and build_gpt_model (also given a ready TransformerConfig)
    refuse before they need megatron-core's parallel state."""
    config = Qwen3Config(**SMALL, attention_bias=True)
    with pytest.raises(Unsupported, match="attention_bias=True"):
        transformer_config_from_hf(config, tp=1, pp=1)
    with pytest.raises(Unsupported, match="attention_bias=True"):
        build_gpt_model(config, pre_process=True, post_process=True, config=object())
