"""Llama-3 / Qwen3 style dense decoders (RMSNorm, GQA, SwiGLU, optional QK-norm,
tied or untied embeddings) from Megatron-core's GPTModel (local layer spec)."""

from __future__ import annotations

from nemo_dcr.converter import (
    TableConverter,
    Dims,
    FusedQKV,
    GatedColumn,
    Replicated,
    RowParallel,
    Rule,
    Tied,
    VocabParallel,
)

ATTN = "decoder.layers.{L}.self_attention"
HF_ATTN = "model.layers.{L}.self_attn"


class LlamaConverter(TableConverter):
    family = "llama"

    def dims(self) -> Dims:
        c = self.hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return Dims(c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads, head_dim)

    def rules(self) -> list[Rule]:
        tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        qkv = tuple(f"{HF_ATTN}.{x}_proj.weight" for x in "qkv")
        qkv_bias = tuple(f"{HF_ATTN}.{x}_proj.bias" for x in "qkv")
        return [
            Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VocabParallel()),
            Rule("decoder.layers.{L}.input_layernorm.weight", ("model.layers.{L}.input_layernorm.weight",), Replicated()),
            Rule(f"{ATTN}.linear_qkv.weight", qkv, FusedQKV()),
            Rule(f"{ATTN}.linear_qkv.bias", qkv_bias, FusedQKV()),
            Rule(f"{ATTN}.q_layernorm.weight", (f"{HF_ATTN}.q_norm.weight",), Replicated()),
            Rule(f"{ATTN}.k_layernorm.weight", (f"{HF_ATTN}.k_norm.weight",), Replicated()),
            Rule(f"{ATTN}.linear_proj.weight", (f"{HF_ATTN}.o_proj.weight",), RowParallel()),
            Rule("decoder.layers.{L}.pre_mlp_layernorm.weight", ("model.layers.{L}.post_attention_layernorm.weight",), Replicated()),
            Rule("decoder.layers.{L}.mlp.linear_fc1.weight",
                 ("model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight"), GatedColumn()),
            Rule("decoder.layers.{L}.mlp.linear_fc2.weight", ("model.layers.{L}.mlp.down_proj.weight",), RowParallel()),
            Rule("decoder.final_layernorm.weight", ("model.norm.weight",), Replicated()),
            Rule("output_layer.weight", ("model.embed_tokens.weight",), Tied(VocabParallel()))
            if tied else Rule("output_layer.weight", ("lm_head.weight",), VocabParallel()),
        ]
