"""Test oracle: a dense Hugging Face export of a Megatron GPT model, by hand.

Deliberately simple and independent of the library's placement code: it gathers
whole tensors (all TP shards via ``all_gather`` on the TP group, all PP stages via
``gather_object`` to global rank 0) and rebuilds the HF Llama / Qwen3 tensors with
the formulas below, reading parameters by module attribute (not by name) and
taking every head / group count from the HF config. Never use it outside tests.

Formulas (per TP rank r of ``tp``; ``nh`` heads, ``ng`` KV groups, ``d`` head dim):

* ``embed_tokens`` / ``lm_head``: cat of the TP vocab shards along dim 0, then the
  padded rows (index >= hf vocab_size) dropped. ``lm_head`` is absent when tied.
* ``linear_qkv`` (interleaved by query group): rank r holds ``ng/tp`` groups, each
  ``[q of its nh/ng heads (nh/ng * d rows); k (d rows); v (d rows)]``, groups in
  order; q/k/v are split per group then concatenated over groups and TP ranks.
* ``linear_proj`` -> ``o_proj``: cat along dim 1.
* ``linear_fc1`` -> rank r holds ``[gate_r; up_r]``: ``gate_proj`` = cat of gate_r,
  ``up_proj`` = cat of up_r (dim 0). ``linear_fc2`` -> ``down_proj``: cat along dim 1.
* MoE layers (Qwen3-MoE / Mixtral names, expert-TP 1): the router (replicated) from TP
  rank 0; local expert e of EP rank r is global expert ``r * E/ep + e``, its
  ``linear_fc1`` ``[gate; up]`` split in halves and ``linear_fc2`` whole; every rank
  contributes its own experts (replicas over expert-DP must agree).
* norms (replicated over TP): from TP rank 0. input_layernorm, pre_mlp_layernorm ->
  post_attention_layernorm, q_layernorm / k_layernorm -> q_norm / k_norm,
  decoder.final_layernorm -> model.norm.

With ``strict`` (default) the oracle also checks, bit for bit, that all DP replicas
hold the same weights, that TP-replicated norms agree across TP ranks, and that the
last stage's copy of a tied output layer equals the embedding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _unwrap(module):
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def _tp_gather(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    tensor = tensor.detach().contiguous()
    if size == 1:
        return [tensor.clone()]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    return parts


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


# model_type -> (router name, per-expert prefix, (gate, up, down) names), as the
# checkpoints spell them
_MOE_NAMES = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{g}.", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{g}.", ("w1", "w3", "w2")),
}


def reference_export(model_chunks, hf_config, *, strict: bool = True):
    """Dense HF state dict on global rank 0 (``None`` elsewhere). Collective: call on
    every rank. Tensors are CPU, contiguous, in the params' dtype (bf16)."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()

    nh = hf_config.num_attention_heads
    ng = getattr(hf_config, "num_key_value_heads", None) or nh
    d = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // nh
    vocab = hf_config.vocab_size
    tied = bool(hf_config.tie_word_embeddings)
    q_per_group = nh // ng
    groups_local = ng // tp

    def gather(t):
        return _tp_gather(t, tp_group, tp)

    def vocab_rows(t):
        return torch.cat(gather(t), dim=0)[:vocab]

    def replicated(t, name):
        parts = gather(t)
        if strict:
            for r, p in enumerate(parts):
                if not _bits_equal(p, parts[0]):
                    raise AssertionError(f"{name}: TP rank {r} differs from TP rank 0")
        return parts[0]

    out: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}  # this rank's own experts, whole (no TP gather)
    tied_copy = None
    for chunk in model_chunks:
        m = _unwrap(chunk)
        if getattr(m, "pre_process", False):
            out["model.embed_tokens.weight"] = vocab_rows(m.embedding.word_embeddings.weight)
        for layer in m.decoder.layers:
            i = int(layer.layer_number) - 1
            pre = f"model.layers.{i}."
            att, mlp = layer.self_attention, layer.mlp

            out[pre + "input_layernorm.weight"] = replicated(
                layer.input_layernorm.weight, pre + "input_layernorm"
            )
            out[pre + "post_attention_layernorm.weight"] = replicated(
                layer.pre_mlp_layernorm.weight, pre + "post_attention_layernorm"
            )
            for src, dst in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
                norm = getattr(att, src, None)
                if norm is not None and getattr(norm, "weight", None) is not None:
                    out[pre + f"self_attn.{dst}.weight"] = replicated(norm.weight, pre + dst)

            for kind in ("weight", "bias"):
                t = getattr(att.linear_qkv, kind, None)
                if t is None or (kind == "bias" and t.numel() == 0):
                    continue
                qs, ks, vs = [], [], []
                for part in gather(t):
                    rows = part.reshape(groups_local, q_per_group + 2, d, *part.shape[1:])
                    qs.append(rows[:, :q_per_group].reshape(-1, *part.shape[1:]))
                    ks.append(rows[:, q_per_group].reshape(-1, *part.shape[1:]))
                    vs.append(rows[:, q_per_group + 1].reshape(-1, *part.shape[1:]))
                out[pre + f"self_attn.q_proj.{kind}"] = torch.cat(qs, dim=0)
                out[pre + f"self_attn.k_proj.{kind}"] = torch.cat(ks, dim=0)
                out[pre + f"self_attn.v_proj.{kind}"] = torch.cat(vs, dim=0)

            out[pre + "self_attn.o_proj.weight"] = torch.cat(
                gather(att.linear_proj.weight), dim=1
            )
            if hasattr(mlp, "router"):
                router, expert, (g_name, u_name, d_name) = _MOE_NAMES[hf_config.model_type]
                out[pre + router] = replicated(mlp.router.weight, pre + router)
                if ps.get_expert_tensor_parallel_world_size() != 1:
                    raise NotImplementedError("the oracle gathers whole experts only (expert-TP 1)")
                local_experts = mlp.experts.local_experts
                first = ps.get_expert_model_parallel_rank() * len(local_experts)
                for e, ex in enumerate(local_experts):
                    name = pre + expert.format(g=first + e)
                    half = ex.linear_fc1.weight.shape[0] // 2
                    experts[name + f"{g_name}.weight"] = ex.linear_fc1.weight[:half]
                    experts[name + f"{u_name}.weight"] = ex.linear_fc1.weight[half:]
                    experts[name + f"{d_name}.weight"] = ex.linear_fc2.weight
                continue
            gates, ups = [], []
            for part in gather(mlp.linear_fc1.weight):
                half = part.shape[0] // 2
                gates.append(part[:half])
                ups.append(part[half:])
            out[pre + "mlp.gate_proj.weight"] = torch.cat(gates, dim=0)
            out[pre + "mlp.up_proj.weight"] = torch.cat(ups, dim=0)
            out[pre + "mlp.down_proj.weight"] = torch.cat(gather(mlp.linear_fc2.weight), dim=1)

        if getattr(m, "post_process", False):
            out["model.norm.weight"] = replicated(
                m.decoder.final_layernorm.weight, "model.norm"
            )
            weight = getattr(m.output_layer, "weight", None)
            if not tied:
                out["lm_head.weight"] = vocab_rows(weight)
            elif weight is not None and not getattr(m, "pre_process", False):
                # Tied under PP: the last stage keeps its own copy of the embedding.
                tied_copy = vocab_rows(weight)

    local = {k: v.detach().cpu().contiguous().clone() for k, v in out.items()} if tp_rank == 0 else {}
    local.update({k: v.detach().cpu().contiguous().clone() for k, v in experts.items()})
    if tied_copy is not None and tp_rank == 0:
        local["__tied_output_copy__"] = tied_copy.cpu().contiguous()
    payload = {
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(with_context_parallel=True),
        "tensors": local,
    }
    world = dist.get_world_size()
    received = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(payload, received, dst=0)
    if dist.get_rank() != 0:
        return None

    result: dict[str, torch.Tensor] = {}
    copies = []
    for item in received:
        for name, tensor in item["tensors"].items():
            if name == "__tied_output_copy__":
                copies.append(tensor)
                continue
            if name not in result:
                result[name] = tensor
            elif strict and not _bits_equal(result[name], tensor):
                raise AssertionError(
                    f"{name}: DP rank {item['dp']} (PP {item['pp']}) differs from another replica"
                )
    if strict:
        for copy in copies:
            if not _bits_equal(copy, result["model.embed_tokens.weight"]):
                raise AssertionError("tied output layer copy differs from the embedding")
    return dict(sorted(result.items()))
