"""Mixtral style decoders (Llama attention / norms / embeddings without QK-norm, every
MLP a routed mixture of SwiGLU experts) from Megatron-core's GPTModel (local layer
spec, SequentialMLP experts: `moe_grouped_gemm=False`).

Canonical names are the *checkpoint's* (what `MixtralForCausalLM.save_pretrained`
writes; transformers 5 fuses the experts in memory only):
`model.layers.<L>.block_sparse_moe.gate.weight` (router, [num_local_experts, hidden])
and `model.layers.<L>.block_sparse_moe.experts.<G>.{w1,w2,w3}.weight`, with w1 = gate,
w3 = up, w2 = down. Expert parallelism and expert-TP work as in `qwen3_moe.py`: "{E}"
turns the EP-local expert index into the global G, `ExpertTP` splits experts over the
expert-TP group, and the router is replicated (TP rank 0 owns it).
"""

from __future__ import annotations

from nemo_dcr.converters.llama import LlamaConverter
from nemo_dcr.converters.qwen3_moe import EXPERT

from nemo_dcr.converter import ExpertTP, GatedColumn, Replicated, RowParallel, Rule

HF_MOE = "model.layers.{L}.block_sparse_moe"


class MixtralConverter(LlamaConverter):
    family = "mixtral"
    demo_model_types = ("mixtral",)

    @classmethod
    def demo_config(cls, model_type, *, experts, **sizes):
        """Top-2 routing over `experts` experts, each as wide as the dense MLP would be."""
        return super().demo_config(model_type, experts=experts, num_local_experts=experts, num_experts_per_tok=2,
                                   **sizes)

    @property
    def num_experts(self) -> int:
        return int(self.hf_config.num_local_experts)

    def rules(self) -> list[Rule]:
        # No dense MLP, and no QK-norm: a model built with either fails at plan().
        dropped = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "q_layernorm.weight", "k_layernorm.weight")
        dense = [r for r in super().rules() if not r.pattern.endswith(dropped)]
        return dense + [
            Rule("decoder.layers.{L}.mlp.router.weight", (f"{HF_MOE}.gate.weight",), Replicated()),
            Rule(f"{EXPERT}.linear_fc1.weight", (f"{HF_MOE}.experts.{{E}}.w1.weight", f"{HF_MOE}.experts.{{E}}.w3.weight"),
                 ExpertTP(GatedColumn())),
            Rule(f"{EXPERT}.linear_fc2.weight", (f"{HF_MOE}.experts.{{E}}.w2.weight",), ExpertTP(RowParallel())),
        ]
