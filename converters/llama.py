"""Llama-3 / Qwen3 style dense decoders (RMSNorm, GQA, SwiGLU, optional QK-norm,
tied or untied embeddings) from Megatron-core's GPTModel, under either layer spec's names:
the local spec's (`input_layernorm`, `pre_mlp_layernorm`) or Transformer Engine's, which
Megatron-Bridge builds and NeMo RL trains (the pre-norms fused into the linear layers that
follow them: `linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`). A model has
one set or the other; both place the same canonical norms. tests/test_bridge_names.py
checks every name against Megatron-Bridge's own mapping registry.

Options (constructor keywords, also through `registry.converter(name, cfg, **options)`):

* `qkv_as_residual=True`: the fused `linear_qkv` weight/bias is a residual rule
  (`ResidualQKV`: each producing rank recomputes its q/k/v rows and sends changes
  as overwrites) instead of affine pieces (`FusedQKV`). Receivers end with the same
  bits. Registered as "qwen3-qkv-residual" / "llama-qkv-residual".
* `zero_centered_norms=True`: every norm weight is stored zero-centred in training
  (Megatron `layernorm_zero_centered_gamma=True`, a TE-spec feature: the local spec
  rejects it) and as 1 + w in the checkpoint (`ZeroCenteredNorm`, a residual).
* `fp8=True`: the canonical checkpoint is fine-grained FP8 (an FP8 rollout checkpoint):
  every linear weight inside a decoder layer (q/k/v, o, gate/up, down) is an `FP8Block`
  residual with targets `<weight>` (F8_E4M3) and `<weight>_scale_inv`; embeddings, norms,
  biases and lm_head stay affine BF16. `fp8_block` (default: the config's
  `quantization_config["weight_block_size"]`, else 128) is the block size. Registered
  as "qwen3-fp8" / "llama-fp8".
"""

from __future__ import annotations

from nemo_dcr.converter import (
    Dims,
    FusedQKV,
    GatedColumn,
    Replicated,
    ResidualQKV,
    RowParallel,
    Rule,
    TableConverter,
    Tied,
    VocabParallel,
    ZeroCenteredNorm,
)
from nemo_dcr.fp8 import FP8Block, fp8_targets

ATTN = "decoder.layers.{L}.self_attention"
HF_ATTN = "model.layers.{L}.self_attn"


class LlamaConverter(TableConverter):
    family = "llama"
    demo_model_types = ("llama", "qwen3")

    @classmethod
    def demo_config(cls, model_type, *, hidden, layers, heads, kv_heads, ffn, vocab, tied, experts, **fields):
        """The Llama-shaped fields every family of this table shares; subclasses add
        theirs as `fields` (e.g. experts)."""
        if model_type not in cls.demo_model_types:
            return None
        from transformers import AutoConfig

        return AutoConfig.for_model(model_type, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                                    num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                                    vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=1024,
                                    rope_theta=10000.0, rms_norm_eps=1e-6, torch_dtype="bfloat16", **fields)

    def __init__(self, hf_config, *, qkv_as_residual: bool = False, zero_centered_norms: bool = False,
                 fp8: bool = False, fp8_block=None):
        self.qkv_as_residual, self.zero_centered_norms, self.fp8 = qkv_as_residual, zero_centered_norms, fp8
        if fp8_block is None:
            quant = getattr(hf_config, "quantization_config", None) or {}
            quant = quant if isinstance(quant, dict) else quant.to_dict()
            fp8_block = quant.get("weight_block_size") or 128
        self.fp8_block = fp8_block
        super().__init__(hf_config)  # compiles rules(), which reads the options

    def dims(self) -> Dims:
        c = self.hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return Dims(c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads, head_dim)

    def rules(self) -> list[Rule]:
        tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        qkv = tuple(f"{HF_ATTN}.{x}_proj.weight" for x in "qkv")
        qkv_bias = tuple(f"{HF_ATTN}.{x}_proj.bias" for x in "qkv")
        fused_qkv = ResidualQKV if self.qkv_as_residual else FusedQKV
        norm = ZeroCenteredNorm if self.zero_centered_norms else Replicated

        def linear(targets, inner):  # an in-layer linear weight: BF16 affine, or FP8 + scales
            return (fp8_targets(*targets), FP8Block(inner, self.fp8_block)) if self.fp8 else (targets, inner)

        fc1 = ("model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight")
        return [
            Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VocabParallel()),
            Rule("decoder.layers.{L}.input_layernorm.weight", ("model.layers.{L}.input_layernorm.weight",), norm()),
            Rule(f"{ATTN}.linear_qkv.layer_norm_weight", ("model.layers.{L}.input_layernorm.weight",), norm()),
            Rule(f"{ATTN}.linear_qkv.weight", *linear(qkv, FusedQKV() if self.fp8 else fused_qkv())),
            Rule(f"{ATTN}.linear_qkv.bias", qkv_bias, fused_qkv()),
            Rule(f"{ATTN}.q_layernorm.weight", (f"{HF_ATTN}.q_norm.weight",), norm()),
            Rule(f"{ATTN}.k_layernorm.weight", (f"{HF_ATTN}.k_norm.weight",), norm()),
            Rule(f"{ATTN}.linear_proj.weight", *linear((f"{HF_ATTN}.o_proj.weight",), RowParallel())),
            Rule("decoder.layers.{L}.pre_mlp_layernorm.weight", ("model.layers.{L}.post_attention_layernorm.weight",), norm()),
            Rule("decoder.layers.{L}.mlp.linear_fc1.layer_norm_weight",
                 ("model.layers.{L}.post_attention_layernorm.weight",), norm()),
            Rule("decoder.layers.{L}.mlp.linear_fc1.weight", *linear(fc1, GatedColumn())),
            Rule("decoder.layers.{L}.mlp.linear_fc2.weight", *linear(("model.layers.{L}.mlp.down_proj.weight",),
                                                                     RowParallel())),
            Rule("decoder.final_layernorm.weight", ("model.norm.weight",), norm()),
            Rule("output_layer.weight", ("model.embed_tokens.weight",), Tied(VocabParallel()))
            if tied else Rule("output_layer.weight", ("lm_head.weight",), VocabParallel()),
        ]


class LlamaQKVResidualConverter(LlamaConverter):
    """The Llama / Qwen3 table with fused QKV declared as a residual (registry names
    "llama-qkv-residual", "qwen3-qkv-residual")."""

    def __init__(self, hf_config, **options):
        options.setdefault("qkv_as_residual", True)
        super().__init__(hf_config, **options)


class LlamaFP8Converter(LlamaConverter):
    """The Llama / Qwen3 table for a fine-grained FP8 rollout checkpoint (registry names
    "llama-fp8", "qwen3-fp8"): in-layer linear weights are `FP8Block` residuals."""

    def __init__(self, hf_config, **options):
        options.setdefault("fp8", True)
        super().__init__(hf_config, **options)
