"""Affine maps vs. an independent, straightforward gather-and-reassemble.

For random small model shapes and TP/PP/DP layouts we make random Megatron-local
shards, reassemble the canonical tensors with plain numpy (concatenate TP shards,
de-interleave QKV weights and biases, split gate/up, drop vocab padding), and require that placing
every owned element through the converter's affine maps writes exactly those
canonical tensors, each element exactly once. The same holds with fused QKV declared
as a residual (its producer recomputes q/k/v rows) and with zero-centred norms
(residual `1 + w`): what the producing ranks send is again exactly the reassembly.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_dcr import registry
from nemo_dcr.converter import check_exact_cover, coverage_report, coverage_runs, merge_runs, owned_intervals
from nemo_dcr.errors import ConverterError
from nemo_dcr.layout import LocalParam, OwnedRange, ParallelLayout
from nemo_dcr.placement import ResidualMap, merge_placed
from nemo_dcr.converters.llama import LlamaConverter
from nemo_dcr.converters.qwen2 import Qwen2Converter


def hf_config(tp, groups_per_tp, q_per_group, head_dim, hidden, ffn_per_tp, vocab, layers, tied, qk_norm,
              qkv_bias=False):
    return SimpleNamespace(
        num_attention_heads=groups_per_tp * tp * q_per_group,
        num_key_value_heads=groups_per_tp * tp,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=ffn_per_tp * tp,
        vocab_size=vocab,
        num_hidden_layers=layers,
        tie_word_embeddings=tied,
        qk_norm=qk_norm,
        qkv_bias=qkv_bias,
    )


def canonical_specs(c):
    h, d = c.hidden_size, c.head_dim
    specs = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        specs["lm_head.weight"] = (c.vocab_size, h)
    for L in range(c.num_hidden_layers):
        p = f"model.layers.{L}."
        specs |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (c.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (c.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": (c.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": (h, c.num_attention_heads * d),
            p + "mlp.gate_proj.weight": (c.intermediate_size, h),
            p + "mlp.up_proj.weight": (c.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, c.intermediate_size),
        }
        if c.qk_norm:
            specs |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if c.qkv_bias:
            specs |= {p + "self_attn.q_proj.bias": (c.num_attention_heads * d,),
                      p + "self_attn.k_proj.bias": (c.num_key_value_heads * d,),
                      p + "self_attn.v_proj.bias": (c.num_key_value_heads * d,)}
    return {k: ("BF16", v) for k, v in specs.items()}


def local_shapes(c, tp, pp, pp_rank, padded_vocab):
    """Megatron param names (global layer ids) and TP-local shapes on one PP stage."""
    h, d = c.hidden_size, c.head_dim
    groups, heads = c.num_key_value_heads, c.num_attention_heads
    per_stage = c.num_hidden_layers // pp
    out = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = (padded_vocab // tp, h)
    for L in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        p = f"decoder.layers.{L}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attention.linear_qkv.weight": ((heads + 2 * groups) * d // tp, h),
            p + "self_attention.linear_proj.weight": (h, heads * d // tp),
            p + "pre_mlp_layernorm.weight": (h,),
            p + "mlp.linear_fc1.weight": (2 * c.intermediate_size // tp, h),
            p + "mlp.linear_fc2.weight": (h, c.intermediate_size // tp),
        }
        if c.qk_norm:
            out |= {p + "self_attention.q_layernorm.weight": (d,), p + "self_attention.k_layernorm.weight": (d,)}
        if c.qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = ((heads + 2 * groups) * d // tp,)
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = (h,)
        if not c.tie_word_embeddings or pp > 1:  # tied + PP>1: last stage keeps a copy
            out["output_layer.weight"] = (padded_vocab // tp, h)
    return out


def one_plus(bits):
    """Oracle for a zero-centred norm: the bf16 bits of 1 + w, for bf16 bits w."""
    w = torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)
    return (w + 1.0).view(torch.int16).numpy().view(np.uint16)


def reassemble(c, shards, tp, padded_vocab, zero_centered=False):
    """The oracle: canonical tensors from all TP shards, written out by hand."""
    d, groups, heads = c.head_dim, c.num_key_value_heads, c.num_attention_heads
    qpg = heads // groups
    cat0 = lambda n: np.concatenate([shards[t][n] for t in range(tp)], axis=0)  # noqa: E731
    cat1 = lambda n: np.concatenate([shards[t][n] for t in range(tp)], axis=1)  # noqa: E731
    out = {"model.embed_tokens.weight": cat0("embedding.word_embeddings.weight")[: c.vocab_size],
           "model.norm.weight": shards[0]["decoder.final_layernorm.weight"]}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = cat0("output_layer.weight")[: c.vocab_size]
    for L in range(c.num_hidden_layers):
        m, p = f"decoder.layers.{L}.", f"model.layers.{L}."
        for kind in ("weight", "bias") if c.qkv_bias else ("weight",):
            fused = cat0(m + "self_attention.linear_qkv." + kind)  # a bias is [rows], a weight [rows, h]
            qkv, cols = fused.reshape(groups, qpg + 2, d, *fused.shape[1:]), fused.shape[1:]
            out[p + "self_attn.q_proj." + kind] = qkv[:, :qpg].reshape(heads * d, *cols)
            out[p + "self_attn.k_proj." + kind] = qkv[:, qpg].reshape(groups * d, *cols)
            out[p + "self_attn.v_proj." + kind] = qkv[:, qpg + 1].reshape(groups * d, *cols)
        out[p + "self_attn.o_proj.weight"] = cat1(m + "self_attention.linear_proj.weight")
        fc1 = [np.split(shards[t][m + "mlp.linear_fc1.weight"], 2) for t in range(tp)]
        out[p + "mlp.gate_proj.weight"] = np.concatenate([g for g, _ in fc1])
        out[p + "mlp.up_proj.weight"] = np.concatenate([u for _, u in fc1])
        out[p + "mlp.down_proj.weight"] = cat1(m + "mlp.linear_fc2.weight")
        out[p + "input_layernorm.weight"] = shards[0][m + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = shards[0][m + "pre_mlp_layernorm.weight"]
        if c.qk_norm:
            out[p + "self_attn.q_norm.weight"] = shards[0][m + "self_attention.q_layernorm.weight"]
            out[p + "self_attn.k_norm.weight"] = shards[0][m + "self_attention.k_layernorm.weight"]
    if zero_centered:
        out = {k: one_plus(v) if k.endswith("norm.weight") else v for k, v in out.items()}
    return out


def sent_by(m, o, bits):
    """What the producer of owned range `o` sends through map `m`, as the Producer does:
    (canonical name, canonical positions, bits) per placed group. `bits`: the whole
    local parameter's bits (uint16)."""
    if not isinstance(m, ResidualMap):
        local_pos = np.arange(o.start, o.stop, dtype=np.int64)
        values = bits.reshape(-1)[o.start:o.stop]
        return [(name, pos, values[src]) for name, (pos, src) in merge_placed(m.place(local_pos)).items()]
    if not m.produced_by(o.start, o.stop):
        return []
    local = torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)
    out = []
    for values, omap in zip(m.compute(local), m.outputs):
        values = values.contiguous().view(torch.int16).numpy().view(np.uint16)
        for name, (pos, src) in merge_placed(omap.place(np.arange(omap.numel, dtype=np.int64))).items():
            out.append((name, pos, values[src]))
    return out


def dp_ranges(shapes: dict, dp: int, rng):
    """Distributed-optimizer style ownership: one flat buffer (params in a random
    order) split into dp contiguous ranges that cut across parameters."""
    names = list(shapes)
    rng.shuffle(names)
    sizes = [int(np.prod(shapes[n])) for n in names]
    total = sum(sizes)
    cuts = np.linspace(0, total, dp + 1).astype(int)
    owned = {r: [] for r in range(dp)}
    offset = 0
    for n, size in zip(names, sizes):
        for r in range(dp):
            lo, hi = max(cuts[r], offset), min(cuts[r + 1], offset + size)
            if hi > lo:
                owned[r].append((n, lo - offset, hi - offset))
        offset += size
    return owned


layouts = st.fixed_dictionaries({
    "tp": st.sampled_from([1, 2, 4]),
    "pp": st.sampled_from([1, 2]),
    "dp": st.sampled_from([1, 2, 3]),
    "groups_per_tp": st.integers(1, 2),
    "q_per_group": st.integers(1, 3),
    "head_dim": st.sampled_from([2, 4]),
    "hidden": st.sampled_from([4, 8]),
    "ffn_per_tp": st.integers(1, 5),
    "vocab": st.integers(5, 40),
    "tied": st.booleans(),
    "qk_norm": st.booleans(),
    "qkv_bias": st.booleans(),
    "qkv_residual": st.booleans(),
    "zero_centered": st.booleans(),
    "seed": st.integers(0, 2**31),
})


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_affine_maps_equal_gather_and_reassemble(lay):
    tp, pp, dp = lay["tp"], lay["pp"], lay["dp"]
    c = hf_config(tp, lay["groups_per_tp"], lay["q_per_group"], lay["head_dim"], lay["hidden"],
                  lay["ffn_per_tp"], lay["vocab"], 2 * pp, lay["tied"], lay["qk_norm"], lay["qkv_bias"])
    rng = np.random.default_rng(lay["seed"])
    padded = -(-c.vocab_size // (4 * tp)) * 4 * tp
    specs = canonical_specs(c)
    # Qwen2 = Llama table + q/k/v biases - QK-norm; the Llama table also maps biases.
    cls = Qwen2Converter if lay["qkv_bias"] and not lay["qk_norm"] else LlamaConverter
    conv = cls(c, qkv_as_residual=lay["qkv_residual"], zero_centered_norms=lay["zero_centered"])
    placed = {n: np.zeros(int(np.prod(s)), np.uint16) for n, (_, s) in specs.items()}
    hits = {n: np.zeros(int(np.prod(s)), np.int64) for n, (_, s) in specs.items()}
    shards = {t: {} for t in range(tp)}
    per_rank_runs, per_rank_intervals = [], []
    for pp_rank in range(pp):
        shapes = local_shapes(c, tp, pp, pp_rank, padded)
        for t in range(tp):
            layout = ParallelLayout(tp_size=tp, tp_rank=t, pp_size=pp, pp_rank=pp_rank)
            bits = {n: rng.integers(0, 2**16, size=s, dtype=np.uint16) for n, s in shapes.items()}
            shards[t] |= bits
            params = [LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()]
            maps = conv.plan(params, layout, specs)
            for r, ranges in dp_ranges(shapes, dp, rng).items():
                owned = [OwnedRange(LocalParam(n, shapes[n], torch.bfloat16), lo, hi, None) for n, lo, hi in ranges]
                per_rank_runs.append(coverage_runs(maps, owned, f"tp{t}/pp{pp_rank}/dp{r}"))
                per_rank_intervals.append(owned_intervals(maps, owned))
                for o in owned:
                    for name, pos, values in sent_by(maps[o.param.name], o, bits[o.param.name]):
                        placed[name][pos.astype(np.int64)] = values
                        np.add.at(hits[name], pos.astype(np.int64), 1)
    expected = reassemble(c, shards, tp, padded, zero_centered=lay["zero_centered"])
    assert set(expected) == set(specs)
    for name, want in expected.items():
        assert np.array_equal(hits[name], np.ones_like(hits[name])), f"{name}: not placed exactly once"
        assert np.array_equal(placed[name], want.reshape(-1)), f"{name}: wrong bits"
    check_exact_cover(merge_runs(per_rank_runs), {n: int(np.prod(s)) for n, (_, s) in specs.items()})
    report = coverage_report(specs, per_rank_intervals)
    residual = {n for n in specs if (lay["qkv_residual"] and "_proj." in n and "self_attn" in n and "o_proj" not in n)
                or (lay["zero_centered"] and n.endswith("norm.weight"))}
    residual_bytes = 2 * sum(hits[n].size for n in residual)
    assert report.total_bytes == 2 * sum(h.size for h in hits.values())
    assert (report.affine_bytes, report.residual_bytes) == (report.total_bytes - residual_bytes, residual_bytes)
    assert report.unplaced_bytes == 0 and not report.unplaced


def small_case(tied=False):
    c = hf_config(2, 1, 2, 4, 8, 3, 30, 2, tied, True)
    return c, canonical_specs(c), local_shapes(c, 2, 1, 0, 32)


def test_unmapped_parameter_is_named():
    c, specs, shapes = small_case()
    params = [LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()]
    params.append(LocalParam("decoder.layers.0.mlp.router.weight", (4, 8), torch.bfloat16))
    with pytest.raises(ConverterError, match="decoder.layers.0.mlp.router.weight"):
        LlamaConverter(c).plan(params, ParallelLayout(tp_size=2), specs)


def test_shape_mismatch_is_named():
    c, specs, shapes = small_case()
    shapes["decoder.layers.1.mlp.linear_fc2.weight"] = (8, 5)
    params = [LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()]
    with pytest.raises(ConverterError, match="linear_fc2.*row-parallel"):
        LlamaConverter(c).plan(params, ParallelLayout(tp_size=2), specs)


def test_dtype_mismatch_is_named():
    c, specs, shapes = small_case()
    params = [LocalParam(n, s, torch.float32 if "fc2" in n else torch.bfloat16) for n, s in shapes.items()]
    with pytest.raises(ConverterError, match="fc2.*not a bit copy"):
        LlamaConverter(c).plan(params, ParallelLayout(tp_size=2), specs)


def test_missing_and_double_ownership_are_named():
    c, specs, shapes = small_case()
    conv = LlamaConverter(c)
    numels = {n: int(np.prod(s)) for n, (_, s) in specs.items()}
    runs = []
    for t in range(2):
        params = [LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()]
        maps = conv.plan(params, ParallelLayout(tp_size=2, tp_rank=t), specs)
        owned = [OwnedRange(p, 0, p.numel, None) for p in params]
        runs.append(coverage_runs(maps, owned, f"tp{t}"))
    check_exact_cover(merge_runs(runs), numels)
    with pytest.raises(ConverterError, match="owned by no rank"):
        check_exact_cover(merge_runs(runs[:1]), numels)
    with pytest.raises(ConverterError, match="owned twice"):
        check_exact_cover(merge_runs([runs[0], runs[0], runs[1]]), numels)


def test_qwen2_table_has_no_qk_norm_and_is_registered():
    c = hf_config(2, 1, 2, 4, 8, 3, 30, 2, False, False, qkv_bias=True)
    assert isinstance(registry.converter("qwen2", c), Qwen2Converter)
    shapes = local_shapes(c, 2, 1, 0, 32)
    shapes["decoder.layers.0.self_attention.q_layernorm.weight"] = (4,)
    params = [LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()]
    with pytest.raises(ConverterError, match="q_layernorm.*not mapped by the qwen2 converter"):
        Qwen2Converter(c).plan(params, ParallelLayout(tp_size=2), canonical_specs(c))


def test_coverage_report_counts_each_canonical_byte_once():
    c, specs, shapes = small_case()
    conv = LlamaConverter(c)
    total = 2 * sum(int(np.prod(s)) for _, s in specs.values())  # bf16
    per_rank = []
    for t in range(2):
        params = [LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()]
        maps = conv.plan(params, ParallelLayout(tp_size=2, tp_rank=t), specs)
        per_rank.append(owned_intervals(maps, [OwnedRange(p, 0, p.numel, None) for p in params]))
    full = coverage_report(specs, per_rank)
    assert (full.total_bytes, full.affine_bytes, full.residual_bytes, full.unplaced) == (total, total, 0, ())
    assert str(full) == "placement: 100.0% of canonical bytes affine, 0.0% residual"
    # Claimed twice: still counted once.
    assert coverage_report(specs, per_rank + per_rank[:1]).affine_bytes == total
    # TP rank 1 missing: its half of every split tensor is reported as unplaced, by name.
    half = coverage_report(specs, per_rank[:1])
    assert half.affine_bytes + half.unplaced_bytes == total and half.affine_bytes > total // 2
    assert dict(half.unplaced)["lm_head.weight"] == 2 * (30 - 16) * 8  # vocab rows 16..29 sit on TP rank 1
    assert "model.norm.weight" not in dict(half.unplaced)  # replicated: TP rank 0 owns it
    assert "unplaced: " in str(half)
    # Intervals past a tensor's end or into unknown tensors count for nothing.
    bogus = {"model.norm.weight": [[0], [10**6]], "not.in.checkpoint": [[0], [99]]}
    assert coverage_report(specs, [bogus]).affine_bytes == 2 * 8
