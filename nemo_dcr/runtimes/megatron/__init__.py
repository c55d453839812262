"""Megatron-core runtime: build GPT models matching HF configs and name their params."""

from nemo_dcr.runtimes.megatron.model import (
    build_gpt_model,
    build_model_chunks,
    check_supported,
    megatron_param_name_map,
    padded_vocab_size,
    rope_theta_of,
    transformer_config_from_hf,
    unwrap_model,
)

__all__ = [
    "build_gpt_model",
    "build_model_chunks",
    "check_supported",
    "megatron_param_name_map",
    "padded_vocab_size",
    "rope_theta_of",
    "transformer_config_from_hf",
    "unwrap_model",
]
