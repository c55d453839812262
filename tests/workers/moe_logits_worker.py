"""torchrun worker: load a Hugging Face Qwen3-MoE or Mixtral checkpoint into Megatron
shards under expert parallelism *through the converter* and compare logits with the HF
model.

World size = tp * dp with ep dividing it (expert-TP 1). The checkpoint's per-expert
tensors (`model.layers.<L>.mlp.experts.<G>.{gate,up,down}_proj.weight`, Mixtral:
`model.layers.<L>.block_sparse_moe.experts.<G>.{w1,w3,w2}.weight`, which the
transformers-5 model fuses in memory) are the canonical names. `--sp` builds the
Megatron model with sequence parallelism. Checks, rank 0 printing "[moe_logits] OK"
when all pass:
1. the loading plan fills every local element of every parameter (no padding in MoE
   tensors except vocab padding);
2. Megatron's logits (eval forward; TP-gathered) equal the HF model's
   (`from_pretrained`) logits within bf16 tolerance (relative error < 0.05).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist


def tiny_moe_config(layers: int, experts: int, family: str = "qwen3_moe"):
    common = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "num_hidden_layers": layers, "num_experts_per_tok": 2, "vocab_size": 500,
              "max_position_embeddings": 64, "initializer_range": 0.1, "tie_word_embeddings": False}
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=experts,
                              norm_topk_prob=True, **common)
    if family == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(intermediate_size=32, num_local_experts=experts, **common)
    raise ValueError(family)


def hf_model_class(hf_config):
    import transformers

    return {"qwen3_moe": transformers.Qwen3MoeForCausalLM,
            "mixtral": transformers.MixtralForCausalLM}[hf_config.model_type]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--ep", type=int, required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "mixtral"])
    ap.add_argument("--sp", action="store_true", help="build with sequence parallelism")
    args = ap.parse_args()

    from nemo_dcr.demo import harness as H

    H.init_distributed(args.tp, 1, ep=args.ep, etp=1, timeout_s=120)
    from megatron.core import parallel_state as ps

    from nemo_dcr import registry
    from nemo_dcr.checkpoint import CheckpointReader, read_specs
    from nemo_dcr.layout import LocalParam, ParallelLayout
    from nemo_dcr.runtimes.megatron.load import load_into
    from nemo_dcr.runtimes.megatron.model import megatron_param_name_map, unwrap_model

    hf_config = tiny_moe_config(args.layers, args.experts, args.family)
    if dist.get_rank() == 0:
        torch.manual_seed(3)
        ref = hf_model_class(hf_config)(hf_config).to(torch.bfloat16)
        with torch.no_grad():  # norms at 1.0 and a near-uniform router would hide misplacements
            for name, p in ref.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
                elif name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 0.5)
        ref.save_pretrained(args.checkpoint)
    dist.barrier()

    model, _ = H.build_trained_model(hf_config, args.tp, 1, lr=1e-3, seed=99, ep=args.ep,  # overwritten below
                                     sequence_parallel=args.sp)
    assert unwrap_model(model[0]).config.sequence_parallel == args.sp
    params = megatron_param_name_map(model)
    layout = ParallelLayout(tp_size=args.tp, tp_rank=ps.get_tensor_model_parallel_rank(),
                            dp_size=H.dp_size(), dp_rank=H.dp_rank(),
                            ep_size=args.ep, ep_rank=ps.get_expert_model_parallel_rank(),
                            etp_size=ps.get_expert_tensor_parallel_world_size(),
                            etp_rank=ps.get_expert_tensor_parallel_rank())
    converter = registry.converter(args.family, hf_config)
    specs = read_specs(args.checkpoint)
    maps = converter.plan([LocalParam(n, tuple(p.shape), p.dtype) for n, p in params.items()], layout, specs,
                          loading=True)
    for name, m in maps.items():  # (1)
        if "word_embeddings" not in name and "output_layer" not in name:
            assert m.covered == params[name].numel(), f"{name}: loading fills {m.covered} of {params[name].numel()}"
    expert_targets = sorted({p.canonical for m in maps.values() for p in m.pieces if ".experts." in p.canonical})
    load_into(params, maps, CheckpointReader(args.checkpoint).get)

    rel = check_moe_logits(model, hf_config, args.checkpoint)  # (2)
    if dist.get_rank() == 0:
        print(f"[moe_logits] {args.family} tp={args.tp} ep={args.ep} dp={H.dp_size()} sp={args.sp} layers={args.layers} "
              f"experts={args.experts} rank0 loads {len(expert_targets)} expert tensors "
              f"(e.g. {expert_targets[-1]}), logits rel err={rel}", flush=True)
        print("[moe_logits] OK", flush=True)
    H.shutdown()


@torch.no_grad()
def check_moe_logits(model, hf_config, checkpoint):
    from megatron.core import parallel_state as ps

    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, hf_config.vocab_size, (2, 16), generator=gen)
    position_ids = torch.arange(16).unsqueeze(0).expand_as(tokens)
    (chunk,) = model
    chunk.eval()  # MoE + TP>1 refuses to *train* without sequence parallelism; eval is fine either way
    local = chunk(tokens, position_ids, None).contiguous()  # [b, s, vocab / tp]
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
    mlogits = torch.cat(parts, dim=-1)[..., : hf_config.vocab_size].float()
    if dist.get_rank() != 0:
        return None
    ref = hf_model_class(hf_config).from_pretrained(checkpoint, dtype=torch.bfloat16, attn_implementation="eager")
    ref.eval()
    hlogits = ref(input_ids=tokens).logits.float()
    rel = float((mlogits - hlogits).norm() / hlogits.norm())
    assert rel < 0.05, f"Megatron vs HF logits: relative error {rel:.3g}"
    return round(rel, 5)


if __name__ == "__main__":
    from tests.support.launch import run_worker

    run_worker(main)
