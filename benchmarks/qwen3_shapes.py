"""Tensor shapes of the benchmarks' stand-in models: a Qwen3-style decoder of a given size
(used by e2e_link.py for its checkpoint and by trainer_speed.py --layout model), and its
mixture-of-experts variant (Qwen3-MoE names; trainer_speed.py --layout moe)."""

from __future__ import annotations


def qwen3_dims(hidden: int, layers: int, vocab: int) -> dict:
    """The config's sizes (transformers' Qwen3Config field names)."""
    heads = max(1, hidden // 128)
    return {"hidden_size": hidden, "intermediate_size": int(hidden * 2.75) // 64 * 64, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
            "head_dim": 128 if hidden >= 128 else hidden, "vocab_size": vocab}


def qwen3_shapes(hidden: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every parameter's Hugging Face name and shape (untied embeddings), in checkpoint order."""
    c = qwen3_dims(hidden, layers, vocab)
    d, f, hd = hidden, c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
    return shapes


def qwen3_moe_shapes(hidden: int, layers: int, vocab: int, experts: int, expert_ffn: int) -> dict[str, tuple[int, ...]]:
    """`qwen3_shapes` with each layer's MLP replaced by a router and `experts` SwiGLU experts
    of intermediate size `expert_ffn`, under Hugging Face Qwen3-MoE names (one tensor per
    expert and projection: a refit codes a record for each of them)."""
    shapes = qwen3_shapes(hidden, layers, vocab)
    for i in range(layers):
        p = f"model.layers.{i}.mlp."
        for proj in ("gate_proj", "up_proj", "down_proj"):
            del shapes[f"{p}{proj}.weight"]
        shapes[p + "gate.weight"] = (experts, hidden)
        for e in range(experts):
            shapes.update({f"{p}experts.{e}.gate_proj.weight": (expert_ffn, hidden),
                           f"{p}experts.{e}.up_proj.weight": (expert_ffn, hidden),
                           f"{p}experts.{e}.down_proj.weight": (hidden, expert_ffn)})
    return shapes
