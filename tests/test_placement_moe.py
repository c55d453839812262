"""MoE placement (Qwen3-MoE table under expert parallelism) vs. a hand reassembly.

Random small models and layouts: TP 1/2 for attention, EP 1/2 (expert-TP 1), PP 1/2,
dense DP 1..3 (EP ranks are carved out of the dense DP x TP ranks, as in Megatron:
per PP stage tp * dp = ep * edp). Every rank plans its dense *and* expert parameters
with one layout; dense parameters are owned in distributed-optimizer ranges over the
dense DP group, expert parameters over the expert-DP group. Placing every owned element
must write exactly the canonical tensors rebuilt by hand (router from TP rank 0, expert
G's gate/up/down from local expert G % n of EP rank G // n), each element exactly once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nemo_dcr.converters.qwen3_moe import Qwen3MoeConverter

from nemo_dcr.converter import check_exact_cover, coverage_runs, merge_runs
from nemo_dcr.errors import ConverterError
from nemo_dcr.layout import LocalParam, OwnedRange, ParallelLayout
from tests.test_placement import (
    canonical_specs,
    dp_ranges,
    hf_config,
    local_shapes,
    reassemble,
    sent_by,
)

DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def moe_config(tp, ep, experts_per_ep, moe_ffn, **dense):
    c = hf_config(tp, **dense)
    c.num_experts, c.moe_intermediate_size = experts_per_ep * ep, moe_ffn
    return c


def moe_specs(c):
    h, f = c.hidden_size, c.moe_intermediate_size
    specs = {k: v for k, v in canonical_specs(c).items() if not k.endswith(DENSE_MLP)}
    for L in range(c.num_hidden_layers):
        p = f"model.layers.{L}.mlp."
        specs[p + "gate.weight"] = ("BF16", (c.num_experts, h))
        for g in range(c.num_experts):
            specs |= {p + f"experts.{g}.gate_proj.weight": ("BF16", (f, h)),
                      p + f"experts.{g}.up_proj.weight": ("BF16", (f, h)),
                      p + f"experts.{g}.down_proj.weight": ("BF16", (h, f))}
    return specs


def dense_shapes(c, tp, pp, pp_rank, padded):
    """Attention / norms / embeddings / router of one (TP, PP) position."""
    out = {k: v for k, v in local_shapes(c, tp, pp, pp_rank, padded).items() if ".mlp.linear_fc" not in k}
    per_stage = c.num_hidden_layers // pp
    for L in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        out[f"decoder.layers.{L}.mlp.router.weight"] = (c.num_experts, c.hidden_size)
    return out


def expert_shapes(c, ep, pp, pp_rank):
    """Local experts of one (EP, PP) position (expert-TP 1: whole experts)."""
    h, f, per_stage = c.hidden_size, c.moe_intermediate_size, c.num_hidden_layers // pp
    out = {}
    for L in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        for e in range(c.num_experts // ep):
            p = f"decoder.layers.{L}.mlp.experts.local_experts.{e}."
            out |= {p + "linear_fc1.weight": (2 * f, h), p + "linear_fc2.weight": (h, f)}
    return out


def reassemble_moe(c, dense, experts, tp, ep, padded):
    """The oracle. Attention etc. through the dense oracle (fed dummy dense MLP shards it
    needs but whose outputs are dropped), router and experts by hand."""
    fake = {t: dict(dense[t]) for t in range(tp)}
    for t in range(tp):
        for L in range(c.num_hidden_layers):
            fake[t][f"decoder.layers.{L}.mlp.linear_fc1.weight"] = np.zeros((2, 1), np.uint16)
            fake[t][f"decoder.layers.{L}.mlp.linear_fc2.weight"] = np.zeros((1, 1), np.uint16)
    out = {k: v for k, v in reassemble(c, fake, tp, padded).items() if not k.endswith(DENSE_MLP)}
    n = c.num_experts // ep
    for L in range(c.num_hidden_layers):
        p = f"model.layers.{L}.mlp."
        out[p + "gate.weight"] = dense[0][f"decoder.layers.{L}.mlp.router.weight"]
        for g in range(c.num_experts):
            m = f"decoder.layers.{L}.mlp.experts.local_experts.{g % n}."
            gate, up = np.split(experts[g // n][m + "linear_fc1.weight"], 2)
            out |= {p + f"experts.{g}.gate_proj.weight": gate, p + f"experts.{g}.up_proj.weight": up,
                    p + f"experts.{g}.down_proj.weight": experts[g // n][m + "linear_fc2.weight"]}
    return out


layouts = st.fixed_dictionaries({
    "tp": st.sampled_from([1, 2]),
    "ep": st.sampled_from([1, 2]),
    "pp": st.sampled_from([1, 2]),
    "dp": st.sampled_from([1, 2, 3]),
    "experts_per_ep": st.integers(1, 3),
    "moe_ffn": st.integers(1, 5),
    "groups_per_tp": st.integers(1, 2),
    "q_per_group": st.integers(1, 2),
    "vocab": st.integers(5, 30),
    "tied": st.booleans(),
    "seed": st.integers(0, 2**31),
})


@settings(max_examples=40, deadline=None)
@given(layouts)
def test_moe_maps_equal_gather_and_reassemble(lay):
    tp, ep, pp, dp = lay["tp"], lay["ep"], lay["pp"], lay["dp"]
    if (tp * dp) % ep:
        dp = ep  # per PP stage, tp * dp ranks must split into ep * edp
    edp = tp * dp // ep
    c = moe_config(tp, ep, lay["experts_per_ep"], lay["moe_ffn"], groups_per_tp=lay["groups_per_tp"],
                   q_per_group=lay["q_per_group"], head_dim=2, hidden=4, ffn_per_tp=1, vocab=lay["vocab"],
                   layers=2 * pp, tied=lay["tied"], qk_norm=True)
    rng = np.random.default_rng(lay["seed"])
    padded = -(-c.vocab_size // (4 * tp)) * 4 * tp
    specs = moe_specs(c)
    conv = Qwen3MoeConverter(c)
    placed = {n: np.zeros(int(np.prod(s)), np.uint16) for n, (_, s) in specs.items()}
    hits = {n: np.zeros(int(np.prod(s)), np.int64) for n, (_, s) in specs.items()}
    dense_bits, expert_bits, runs = {t: {} for t in range(tp)}, {e: {} for e in range(ep)}, []
    for pp_rank in range(pp):
        dshapes, eshapes = dense_shapes(c, tp, pp, pp_rank, padded), expert_shapes(c, ep, pp, pp_rank)
        dbits = {t: {n: rng.integers(0, 2**16, size=s, dtype=np.uint16) for n, s in dshapes.items()}
                 for t in range(tp)}
        ebits = {e: {n: rng.integers(0, 2**16, size=s, dtype=np.uint16) for n, s in eshapes.items()}
                 for e in range(ep)}
        for t in range(tp):
            dense_bits[t] |= dbits[t]
        for e in range(ep):
            expert_bits[e] |= ebits[e]
        dranges = {t: dp_ranges(dshapes, dp, rng) for t in range(tp)}  # per TP position, over dense DP
        eranges = {e: dp_ranges(eshapes, edp, rng) for e in range(ep)}  # per EP position, over expert DP
        for i in range(tp * dp):  # the ranks of this PP stage
            t, d, e, ed = i % tp, i // tp, i % ep, i // ep
            layout = ParallelLayout(tp_size=tp, tp_rank=t, pp_size=pp, pp_rank=pp_rank, dp_size=dp, dp_rank=d,
                                    ep_size=ep, ep_rank=e)
            shapes = dshapes | eshapes
            maps = conv.plan([LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()], layout, specs)
            owned = [(n, lo, hi, dbits[t][n]) for n, lo, hi in dranges[t][d]]
            owned += [(n, lo, hi, ebits[e][n]) for n, lo, hi in eranges[e][ed]]
            ranges = [OwnedRange(LocalParam(n, shapes[n], torch.bfloat16), lo, hi, None) for n, lo, hi, _ in owned]
            runs.append(coverage_runs(maps, ranges, f"pp{pp_rank}/tp{t}/dp{d}/ep{e}/edp{ed}"))
            for o, (_, _, _, bits) in zip(ranges, owned):
                for name, pos, values in sent_by(maps[o.param.name], o, bits):
                    placed[name][pos.astype(np.int64)] = values
                    np.add.at(hits[name], pos.astype(np.int64), 1)
    expected = reassemble_moe(c, dense_bits, expert_bits, tp, ep, padded)
    assert set(expected) == set(specs)
    for name, want in expected.items():
        assert np.array_equal(hits[name], np.ones_like(hits[name])), f"{name}: not placed exactly once"
        assert np.array_equal(placed[name], want.reshape(-1)), f"{name}: wrong bits"
    check_exact_cover(merge_runs(runs), {n: int(np.prod(s)) for n, (_, s) in specs.items()})


def small_moe():
    c = moe_config(1, 2, 2, 3, groups_per_tp=1, q_per_group=2, head_dim=2, hidden=4, ffn_per_tp=1, vocab=10,
                   layers=1, tied=False, qk_norm=True)
    return c, moe_specs(c), dense_shapes(c, 1, 1, 0, 12) | expert_shapes(c, 2, 1, 0)


def test_local_expert_index_maps_through_ep_rank():
    c, specs, shapes = small_moe()
    conv = Qwen3MoeConverter(c)
    name = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"
    for ep_rank, g in ((0, 1), (1, 3)):
        maps = conv.plan([LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()],
                         ParallelLayout(ep_size=2, ep_rank=ep_rank), specs)
        assert {p.canonical for p in maps[name].pieces} == {f"model.layers.0.mlp.experts.{g}.down_proj.weight"}


def test_expert_index_out_of_range_is_named():
    c, specs, shapes = small_moe()
    shapes["decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight"] = (4, 3)
    with pytest.raises(ConverterError, match="local expert 2 out of range"):
        Qwen3MoeConverter(c).plan([LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()],
                                  ParallelLayout(ep_size=2, ep_rank=1), specs)


def test_expert_rule_without_layout_is_refused():
    c, _, _ = small_moe()
    with pytest.raises(ConverterError, match="needs the layout"):
        Qwen3MoeConverter(c).match("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight")
