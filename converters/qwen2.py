"""Qwen2 / Qwen2.5 style dense decoders: the Llama table with q/k/v biases and no
QK-norm.

Qwen2 biases q_proj, k_proj and v_proj (not o_proj). Megatron holds the three as one
`linear_qkv.bias` (add_qkv_bias) in the same per-query-group [q; k; v] layout as the
fused weight, so the bias maps exactly like the weight: the `linear_qkv.bias` rule
with `FusedQKV` of the Llama table. A model built without the bias leaves the
canonical q/k/v biases owned by no rank, which the start-up cover check names.
"""

from __future__ import annotations

from nemo_dcr.converters.llama import LlamaConverter


class Qwen2Converter(LlamaConverter):
    family = "qwen2"
    demo_model_types = ("qwen2",)

    def rules(self):
        # Qwen2 has no QK-norm: without these rules a model built with one fails at plan().
        qk_norm = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
        return [r for r in super().rules() if not r.pattern.endswith(qk_norm)]
