"""Qwen3-MoE style decoders (the Qwen3 attention / norms / embeddings, every MLP a
routed mixture of SwiGLU experts, no shared experts) from Megatron-core's GPTModel, under
the local spec's names or Transformer Engine's (see converters/llama.py), with experts as
SequentialMLP modules (`moe_grouped_gemm=False`: `mlp.experts.local_experts.<e>.linear_fc1.weight`)
or grouped GEMMs (`moe_grouped_gemm=True`, TE: `mlp.experts.linear_fc1.weight<e>`); the MoE
layer's pre-MLP norm stays `pre_mlp_layernorm` under both specs.

Expert parallelism: EP rank r holds experts [r * n, (r + 1) * n), n = num_experts /
ep_size, as `mlp.experts.local_experts.<e>` with the EP-local index e; the "{E}"
placeholder maps e to the global index of the checkpoint's per-expert tensors
(`model.layers.<L>.mlp.experts.<r*n+e>.{gate,up,down}_proj.weight`). Expert weights
are split over the *expert*-TP group (`ParallelLayout.etp_*`), not the dense TP group:
`ExpertTP` hands the inner mapping the expert-TP coordinates. The router
(`mlp.router.weight`, [num_experts, hidden]) is replicated over TP (and over EP: EP
ranks are data-parallel replicas of every dense parameter): TP rank 0 owns it.
"""

from __future__ import annotations

from nemo_dcr.converters.llama import LlamaConverter

from nemo_dcr.converter import ExpertTP, GatedColumn, Replicated, RowParallel, Rule

EXPERT = "decoder.layers.{L}.mlp.experts.local_experts.{E}"
GROUPED = "decoder.layers.{L}.mlp.experts"  # grouped GEMM: weight<e> per EP-local expert e
HF_EXPERT = "model.layers.{L}.mlp.experts.{E}"


class Qwen3MoeConverter(LlamaConverter):
    family = "qwen3_moe"
    demo_model_types = ("qwen3_moe",)

    @classmethod
    def demo_config(cls, model_type, *, experts, ffn, **sizes):
        """Top-2 routing over `experts` experts, each ffn/4 wide."""
        return super().demo_config(model_type, experts=experts, ffn=ffn, num_experts=experts, num_experts_per_tok=2,
                                   moe_intermediate_size=ffn // 4, **sizes)

    @property
    def num_experts(self) -> int:
        return int(self.hf_config.num_experts)

    def rules(self) -> list[Rule]:
        dense = [r for r in super().rules() if ".mlp.linear_fc" not in r.pattern]
        return dense + [
            Rule("decoder.layers.{L}.mlp.router.weight", ("model.layers.{L}.mlp.gate.weight",), Replicated()),
            Rule(f"{EXPERT}.linear_fc1.weight", (f"{HF_EXPERT}.gate_proj.weight", f"{HF_EXPERT}.up_proj.weight"),
                 ExpertTP(GatedColumn())),
            Rule(f"{EXPERT}.linear_fc2.weight", (f"{HF_EXPERT}.down_proj.weight",), ExpertTP(RowParallel())),
            Rule(f"{GROUPED}.linear_fc1.weight{{E}}",
                 (f"{HF_EXPERT}.gate_proj.weight", f"{HF_EXPERT}.up_proj.weight"), ExpertTP(GatedColumn())),
            Rule(f"{GROUPED}.linear_fc2.weight{{E}}", (f"{HF_EXPERT}.down_proj.weight",), ExpertTP(RowParallel())),
        ]
