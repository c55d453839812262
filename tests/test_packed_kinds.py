"""`PackedQKV` and `PackedGateUp` (one canonical tensor [q; k; v] / [gate; up], as Phi-3's
`qkv_proj` / `gate_up_proj`) against Megatron's layout written out by hand.

Random canonical tensors are cut into the TP shards Megatron holds (per query group
[q heads; k; v]; per rank [gate_r; up_r]), and placing every shard element through the
kind's pieces must rebuild the packed tensor, each element exactly once. The unpacked
kinds (`FusedQKV`, `GatedColumn`) must place the same shards into the same rows of
their separate targets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_dcr.converter import Context, Dims, FusedQKV, GatedColumn, PackedGateUp, PackedQKV, plan_param
from nemo_dcr.errors import ConverterError
from nemo_dcr.layout import LocalParam, ParallelLayout
from nemo_dcr.placement import merge_placed


def place(mapping, shards: list[np.ndarray], targets: dict[str, tuple], dims=None) -> dict[str, np.ndarray]:
    """Every TP rank's shard placed through `mapping`; asserts each canonical element is written once."""
    out = {n: np.zeros(int(np.prod(s)), np.int64) for n, s in targets.items()}
    hits = {n: np.zeros(int(np.prod(s)), np.int64) for n, s in targets.items()}
    specs = {n: ("BF16", s) for n, s in targets.items()}
    for r, shard in enumerate(shards):
        ctx = Context(LocalParam("p", shard.shape, torch.bfloat16), ParallelLayout(tp_size=len(shards), tp_rank=r),
                      tuple(targets), specs, dims)
        amap = plan_param(mapping, ctx)
        for name, (pos, src) in merge_placed(amap.place(np.arange(shard.size, dtype=np.int64))).items():
            out[name][pos.astype(np.int64)] = shard.reshape(-1)[src]
            np.add.at(hits[name], pos.astype(np.int64), 1)
    for name, h in hits.items():
        assert (h == 1).all(), f"{name}: not every element placed exactly once"
    return {n: v.reshape(targets[n]) for n, v in out.items()}


def qkv_shards(q, k, v, groups: int, tp: int) -> list[np.ndarray]:
    """Megatron's `linear_qkv` shards: rank r holds groups [r*n, (r+1)*n), each [its q heads; k; v]."""
    qg, kg, vg = (np.split(x, groups) for x in (q, k, v))
    per_rank = groups // tp
    return [np.concatenate([np.concatenate([qg[g], kg[g], vg[g]]) for g in range(r * per_rank, (r + 1) * per_rank)])
            for r in range(tp)]


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), groups_per_tp=st.integers(1, 3), q_per_group=st.integers(1, 3),
       head_dim=st.sampled_from([1, 2, 4]), cols=st.sampled_from([None, 3, 8]), seed=st.integers(0, 2**31))
def test_packed_qkv_rebuilds_q_k_v_in_one_tensor(tp, groups_per_tp, q_per_group, head_dim, cols, seed):
    rng = np.random.default_rng(seed)
    groups = groups_per_tp * tp
    heads = groups * q_per_group
    tail = () if cols is None else (cols,)  # a bias, or a weight
    q = rng.integers(0, 2**16, (heads * head_dim, *tail))
    k, v = (rng.integers(0, 2**16, (groups * head_dim, *tail)) for _ in range(2))
    shards, dims = qkv_shards(q, k, v, groups, tp), Dims(heads, groups, head_dim)
    rows = (heads + 2 * groups) * head_dim
    packed = place(PackedQKV(), shards, {"qkv": (rows, *tail)}, dims)["qkv"]
    assert np.array_equal(packed, np.concatenate([q, k, v]))
    split = place(FusedQKV(), shards, {"q": q.shape, "k": k.shape, "v": v.shape}, dims)
    assert all(np.array_equal(split[n], x) for n, x in (("q", q), ("k", k), ("v", v)))


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), ffn_per_tp=st.integers(1, 5), cols=st.sampled_from([None, 3, 8]),
       seed=st.integers(0, 2**31))
def test_packed_gate_up_rebuilds_gate_and_up_in_one_tensor(tp, ffn_per_tp, cols, seed):
    rng = np.random.default_rng(seed)
    tail = () if cols is None else (cols,)
    gate, up = (rng.integers(0, 2**16, (ffn_per_tp * tp, *tail)) for _ in range(2))
    shards = [np.concatenate([g, u]) for g, u in zip(np.split(gate, tp), np.split(up, tp))]
    packed = place(PackedGateUp(), shards, {"gate_up": (2 * ffn_per_tp * tp, *tail)})["gate_up"]
    assert np.array_equal(packed, np.concatenate([gate, up]))
    split = place(GatedColumn(), shards, {"gate": gate.shape, "up": up.shape})
    assert np.array_equal(split["gate"], gate) and np.array_equal(split["up"], up)


def test_packed_shapes_that_do_not_fit_are_named():
    dims = Dims(num_heads=4, num_query_groups=2, head_dim=2)
    with pytest.raises(ConverterError, match=r"canonical qkv has shape \(12, 8\), expected 16 rows of 8"):
        place(PackedQKV(), [np.zeros((8, 8))] * 2, {"qkv": (12, 8)}, dims)  # k and v left out
    with pytest.raises(ConverterError, match=r"canonical gate_up \(6, 8\) is not 4 x \(3, 8\)"):
        place(PackedGateUp(), [np.zeros((6, 8))] * 2, {"gate_up": (6, 8)})  # the gate half only
