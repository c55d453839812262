"""MoE placement (Qwen3-MoE and Mixtral tables under expert parallelism) vs. a hand
reassembly.

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

from nemo_dcr import registry
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

# Per family, from its HF checkpoint: the config fields holding the expert count and the
# expert FFN size, the router tensor and per-expert (gate, up, down) tensors under
# model.layers.<L>., and whether attention has QK-norm.
FAMILIES = {
    "qwen3_moe": {"experts": "num_experts", "ffn": "moe_intermediate_size", "router": "mlp.gate.weight",
                  "expert": ("mlp.experts.{G}.gate_proj.weight", "mlp.experts.{G}.up_proj.weight",
                             "mlp.experts.{G}.down_proj.weight"), "qk_norm": True},
    "mixtral": {"experts": "num_local_experts", "ffn": "intermediate_size", "router": "block_sparse_moe.gate.weight",
                "expert": ("block_sparse_moe.experts.{G}.w1.weight", "block_sparse_moe.experts.{G}.w3.weight",
                           "block_sparse_moe.experts.{G}.w2.weight"), "qk_norm": False},
}


def moe_config(tp, ep, experts_per_ep, moe_ffn, family="qwen3_moe", **dense):
    c = hf_config(tp, **dense)
    f = FAMILIES[family]
    setattr(c, f["experts"], experts_per_ep * ep)
    setattr(c, f["ffn"], moe_ffn)
    return c


def n_experts(c, family):
    return getattr(c, FAMILIES[family]["experts"])


def expert_ffn(c, family):
    return getattr(c, FAMILIES[family]["ffn"])


def moe_specs(c, family="qwen3_moe"):
    h, f, fam = c.hidden_size, expert_ffn(c, family), FAMILIES[family]
    specs = {k: v for k, v in canonical_specs(c).items() if not k.endswith(DENSE_MLP)}
    for L in range(c.num_hidden_layers):
        p = f"model.layers.{L}."
        specs[p + fam["router"]] = ("BF16", (n_experts(c, family), h))
        for g in range(n_experts(c, family)):
            gate, up, down = (p + t.format(G=g) for t in fam["expert"])
            specs |= {gate: ("BF16", (f, h)), up: ("BF16", (f, h)), down: ("BF16", (h, f))}
    return specs


def dense_shapes(c, tp, pp, pp_rank, padded, family="qwen3_moe"):
    """Attention / norms / embeddings / router of one (TP, PP) position."""
    out = {k: v for k, v in local_shapes(c, tp, pp, pp_rank, padded).items() if ".mlp.linear_fc" not in k}
    per_stage = c.num_hidden_layers // pp
    for L in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        out[f"decoder.layers.{L}.mlp.router.weight"] = (n_experts(c, family), c.hidden_size)
    return out


def expert_shapes(c, ep, pp, pp_rank, family="qwen3_moe"):
    """Local experts of one (EP, PP) position (expert-TP 1: whole experts)."""
    h, f, per_stage = c.hidden_size, expert_ffn(c, family), c.num_hidden_layers // pp
    out = {}
    for L in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        for e in range(n_experts(c, family) // ep):
            p = f"decoder.layers.{L}.mlp.experts.local_experts.{e}."
            out |= {p + "linear_fc1.weight": (2 * f, h), p + "linear_fc2.weight": (h, f)}
    return out


def reassemble_moe(c, dense, experts, tp, ep, padded, family="qwen3_moe"):
    """The oracle. Attention etc. through the dense oracle (fed dummy dense MLP shards it
    needs but whose outputs are dropped), router and experts by hand: Megatron's
    linear_fc1 is [gate; up], linear_fc2 is down."""
    fake = {t: dict(dense[t]) for t in range(tp)}
    for t in range(tp):
        for L in range(c.num_hidden_layers):
            fake[t][f"decoder.layers.{L}.mlp.linear_fc1.weight"] = np.zeros((2, 1), np.uint16)
            fake[t][f"decoder.layers.{L}.mlp.linear_fc2.weight"] = np.zeros((1, 1), np.uint16)
    out = {k: v for k, v in reassemble(c, fake, tp, padded).items() if not k.endswith(DENSE_MLP)}
    fam, n = FAMILIES[family], n_experts(c, family) // ep
    for L in range(c.num_hidden_layers):
        p = f"model.layers.{L}."
        out[p + fam["router"]] = dense[0][f"decoder.layers.{L}.mlp.router.weight"]
        for g in range(n_experts(c, family)):
            m = f"decoder.layers.{L}.mlp.experts.local_experts.{g % n}."
            gate_name, up_name, down_name = (p + t.format(G=g) for t in fam["expert"])
            out[gate_name], out[up_name] = np.split(experts[g // n][m + "linear_fc1.weight"], 2)
            out[down_name] = experts[g // n][m + "linear_fc2.weight"]
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


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=40, deadline=None)
@given(lay=layouts)
def test_moe_maps_equal_gather_and_reassemble(family, lay):
    tp, ep, pp, dp = lay["tp"], lay["ep"], lay["pp"], lay["dp"]
    if (tp * dp) % ep:
        dp = ep  # per PP stage, tp * dp ranks must split into ep * edp
    edp = tp * dp // ep
    c = moe_config(tp, ep, lay["experts_per_ep"], lay["moe_ffn"], family, groups_per_tp=lay["groups_per_tp"],
                   q_per_group=lay["q_per_group"], head_dim=2, hidden=4, ffn_per_tp=1, vocab=lay["vocab"],
                   layers=2 * pp, tied=lay["tied"], qk_norm=FAMILIES[family]["qk_norm"])
    rng = np.random.default_rng(lay["seed"])
    padded = -(-c.vocab_size // (4 * tp)) * 4 * tp
    specs = moe_specs(c, family)
    conv = registry.converter(family, c)
    placed = {n: np.zeros(int(np.prod(s)), np.uint16) for n, (_, s) in specs.items()}
    hits = {n: np.zeros(int(np.prod(s)), np.int64) for n, (_, s) in specs.items()}
    dense_bits, expert_bits, runs = {t: {} for t in range(tp)}, {e: {} for e in range(ep)}, []
    for pp_rank in range(pp):
        dshapes, eshapes = dense_shapes(c, tp, pp, pp_rank, padded, family), expert_shapes(c, ep, pp, pp_rank, family)
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
    expected = reassemble_moe(c, dense_bits, expert_bits, tp, ep, padded, family)
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


def test_mixtral_expert_tp_splits_w1_w3_w2():
    """Expert-TP 2 (dense TP 2): rank r holds [w1_r; w3_r] and w2's column block r."""
    f, h, etp = 4, 4, 2
    c = moe_config(2, 1, 2, f, "mixtral", groups_per_tp=1, q_per_group=1, head_dim=2, hidden=h, ffn_per_tp=1,
                   vocab=10, layers=1, tied=False, qk_norm=False)
    specs, conv, rng = moe_specs(c, "mixtral"), registry.converter("mixtral", c), np.random.default_rng(0)
    local = {f"decoder.layers.0.mlp.experts.local_experts.{e}.{n}": s for e in range(2)
             for n, s in (("linear_fc1.weight", (2 * f // etp, h)), ("linear_fc2.weight", (h, f // etp)))}
    placed, shards = {n: np.zeros(int(np.prod(s)), np.uint16) for n, (_, s) in specs.items()}, []
    for r in range(etp):
        bits = {n: rng.integers(0, 2**16, size=s, dtype=np.uint16) for n, s in local.items()}
        shards.append(bits)
        layout = ParallelLayout(tp_size=2, tp_rank=r, etp_size=etp, etp_rank=r)
        maps = conv.plan([LocalParam(n, s, torch.bfloat16) for n, s in local.items()], layout, specs)
        for n, s in local.items():
            o = OwnedRange(LocalParam(n, s, torch.bfloat16), 0, int(np.prod(s)), None)
            for name, pos, values in sent_by(maps[n], o, bits[n]):
                placed[name][pos.astype(np.int64)] = values
    for e in range(2):
        m, p = f"decoder.layers.0.mlp.experts.local_experts.{e}.", f"model.layers.0.block_sparse_moe.experts.{e}."
        halves = [np.split(s[m + "linear_fc1.weight"], 2) for s in shards]
        want = {"w1": np.concatenate([g for g, _ in halves]), "w3": np.concatenate([u for _, u in halves]),
                "w2": np.concatenate([s[m + "linear_fc2.weight"] for s in shards], axis=1)}
        for w, arr in want.items():
            assert np.array_equal(placed[p + w + ".weight"], arr.reshape(-1)), f"expert {e} {w}: wrong bits"


def test_mixtral_table_rejects_qk_norm_and_dense_mlp():
    c = moe_config(1, 1, 2, 3, "mixtral", groups_per_tp=1, q_per_group=2, head_dim=2, hidden=4, ffn_per_tp=1,
                   vocab=10, layers=1, tied=False, qk_norm=False)
    conv, specs = registry.converter("mixtral", c), moe_specs(c, "mixtral")
    for extra in ("decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.0.mlp.linear_fc2.weight"):
        params = [LocalParam(n, s, torch.bfloat16) for n, s in (dense_shapes(c, 1, 1, 0, 12, "mixtral")
                                                                | expert_shapes(c, 1, 1, 0, "mixtral")).items()]
        params.append(LocalParam(extra, (2,), torch.bfloat16))
        with pytest.raises(ConverterError, match=f"{extra}.*not mapped by the mixtral converter"):
            conv.plan(params, ParallelLayout(), specs)


def test_mixtral_router_name_is_the_checkpoints():
    c = moe_config(1, 2, 2, 3, "mixtral", groups_per_tp=1, q_per_group=2, head_dim=2, hidden=4, ffn_per_tp=1,
                   vocab=10, layers=1, tied=False, qk_norm=False)
    specs = moe_specs(c, "mixtral")
    del specs["model.layers.0.block_sparse_moe.gate.weight"]
    specs["model.layers.0.mlp.gate.weight"] = ("BF16", (4, 4))  # transformers 5's in-memory name
    shapes = dense_shapes(c, 1, 1, 0, 12, "mixtral") | expert_shapes(c, 2, 1, 0, "mixtral")
    with pytest.raises(ConverterError, match="block_sparse_moe.gate.weight' is not in the checkpoint"):
        registry.converter("mixtral", c).plan([LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()],
                                              ParallelLayout(ep_size=2), specs)
