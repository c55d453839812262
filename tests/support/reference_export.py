"""Test oracle: a dense Hugging Face export of a Megatron GPT model, by whole-tensor gathers.

What it takes from the converter is only what the family *declares*: its rules (which
Megatron parameter goes to which canonical tensors, under which mapping kind) and its
`dims()`. What each kind means is written out below once, as a formula on whole gathered
tensors, independent of the library's placement code (no pieces, no affine maps): a new
family needs no code here, a new *kind* needs one formula. Never use it outside tests.

It gathers every parameter's TP shards with ``all_gather`` (over the expert-TP group for
``ExpertTP`` kinds), turns them into canonical tensors on the group's first rank, and
collects all PP stages and replicas on global rank 0 with ``gather_object``. Parameters
are named as the rules spell them: wrapper prefixes dropped, layer indices global (from
each layer's ``layer_number``).

Formulas (shards ``s_0 .. s_{tp-1}`` in rank order; ``nh`` heads, ``ng`` KV groups, ``d``
head dim, from ``converter.dims()``):

* ``Replicated``: ``s_0`` (all shards must agree).
* ``ColumnParallel`` / ``RowParallel``: cat along dim 0 / dim 1.
* ``VocabParallel``: cat along dim 0, rows past the HF ``vocab_size`` (padding) dropped.
* ``FusedQKV`` / ``ResidualQKV``: each shard is ``ng/tp`` query groups of ``[q (nh/ng * d
  rows); k (d); v (d)]``; q, k and v are split per group and concatenated over groups and
  shards. ``PackedQKV``: the one tensor ``[q; k; v]``.
* ``GatedColumn``: each shard is ``[gate_r; up_r]``; gate = cat of the gate halves, up =
  cat of the up halves. ``PackedGateUp``: the one tensor ``[gate; up]``.
* ``ValueTransform`` (e.g. ``ZeroCenteredNorm``): its inner kind's formula on ``fn(s_r)``.
* ``ExpertTP``: its inner kind's formula over the expert-TP shards. ``{E}`` in targets is
  the global expert ``ep_rank * (num_experts / ep) + e``.
* ``Tied``: no tensor of its own; its inner formula must give the owner's tensor.

With ``strict`` (default) the oracle also checks, bit for bit, that all DP replicas hold
the same weights, that replicated shards agree across TP ranks, and that a tied copy
equals the tensor it is tied to.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from nemo_dcr.converter import (ColumnParallel, ExpertTP, FusedQKV, GatedColumn, PackedGateUp, PackedQKV, Replicated,
                                ResidualQKV, RowParallel, TableConverter, Tied, ValueTransform, VocabParallel)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _unwrap(module):
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def _named_params(model_chunks):
    """(name as the rules spell it, param) over this rank's model chunks."""
    for chunk in model_chunks:
        m = _unwrap(chunk)
        layers = getattr(getattr(m, "decoder", None), "layers", [])
        index = {i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}  # layer_number: global, from 1
        for name, p in m.named_parameters():
            hit = _LAYER.match(name)
            if hit:
                name = f"decoder.layers.{index[int(hit[1])]}.{name[hit.end():]}"
            yield name, p


def _gather(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
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


def _qkv(parts, dims) -> list[torch.Tensor]:
    """Whole q, k, v from fused shards of [q heads; k; v] per query group."""
    per_group = dims.num_heads // dims.num_query_groups
    q, k, v = [], [], []
    for part in parts:
        tail = part.shape[1:]
        rows = part.reshape(-1, per_group + 2, dims.head_dim, *tail)
        q.append(rows[:, :per_group].reshape(-1, *tail))
        k.append(rows[:, per_group].reshape(-1, *tail))
        v.append(rows[:, per_group + 1].reshape(-1, *tail))
    return [torch.cat(x, dim=0) for x in (q, k, v)]


def _gate_up(parts) -> list[torch.Tensor]:
    """Whole gate and up from shards of [gate_r; up_r]."""
    halves = [part.chunk(2, dim=0) for part in parts]
    return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]


def _replicated(m, parts, targets, env):
    if env["strict"]:
        for r, p in enumerate(parts):
            if not _bits_equal(p, parts[0]):
                raise AssertionError(f"{targets[0]}: shard {r} of a replicated parameter differs from shard 0")
    return {targets[0]: parts[0]}


_FORMULAS = {
    Replicated: _replicated,
    ColumnParallel: lambda m, parts, targets, env: {targets[0]: torch.cat(parts, dim=0)},
    RowParallel: lambda m, parts, targets, env: {targets[0]: torch.cat(parts, dim=1)},
    VocabParallel: lambda m, parts, targets, env: {targets[0]: torch.cat(parts, dim=0)[:env["vocab"]]},
    FusedQKV: lambda m, parts, targets, env: dict(zip(targets, _qkv(parts, env["dims"]))),
    ResidualQKV: lambda m, parts, targets, env: dict(zip(targets, _qkv(parts, env["dims"]))),
    PackedQKV: lambda m, parts, targets, env: {targets[0]: torch.cat(_qkv(parts, env["dims"]), dim=0)},
    GatedColumn: lambda m, parts, targets, env: dict(zip(targets, _gate_up(parts))),
    PackedGateUp: lambda m, parts, targets, env: {targets[0]: torch.cat(_gate_up(parts), dim=0)},
    ValueTransform: lambda m, parts, targets, env: _canonical(m.inner, [m.fn(p) for p in parts], targets, env),
    ExpertTP: lambda m, parts, targets, env: _canonical(m.inner, parts, targets, env),
    Tied: lambda m, parts, targets, env: _canonical(m.inner, parts, targets, env),
}


def _canonical(mapping, parts, targets, env) -> dict[str, torch.Tensor]:
    """Whole canonical tensors of one parameter from all of its shards (rank order)."""
    for kind in type(mapping).__mro__:
        if kind in _FORMULAS:
            return _FORMULAS[kind](mapping, parts, targets, env)
    raise NotImplementedError(f"the test oracle has no formula for the {type(mapping).__name__} kind: add one "
                              "to tests/support/reference_export.py")


def _rule_for(rules, name: str, experts_per_rank: int, ep_rank: int):
    """(mapping, targets) of the one rule whose pattern matches `name`, placeholders filled."""
    hits = [(r, m) for r, rx in rules if (m := rx.match(name))]
    if len(hits) != 1:
        raise AssertionError(f"{name}: matches {len(hits)} of the converter's rules, not one")
    rule, m = hits[0]
    fill = {k: v for k, v in m.groupdict().items() if v is not None}
    if "E" in fill:  # EP-local expert index in the name, global index in the checkpoint
        fill["E"] = str(ep_rank * experts_per_rank + int(fill["E"]))
    targets = []
    for t in rule.targets:
        for k, v in fill.items():
            t = t.replace("{" + k + "}", v)
        targets.append(t)
    return rule.mapping, tuple(targets)


def reference_export(model_chunks, hf_config, *, family: str | None = None, strict: bool = True):
    """Dense HF state dict on global rank 0 (``None`` elsewhere). Collective: call on
    every rank. Tensors are CPU, contiguous, in the params' dtype (bf16).

    ``family``: the registered converter whose rules say what each parameter is (default
    ``hf_config.model_type``), built without options: its plain table, since how a refit
    *sends* values (e.g. fused QKV as a residual) does not change what the dense export is."""
    from megatron.core import parallel_state as ps

    from nemo_dcr import registry

    converter = registry.converter(family or hf_config.model_type, hf_config)
    if not isinstance(converter, TableConverter):
        raise TypeError(f"the oracle reads declared rules: {type(converter).__name__} is not a TableConverter")
    groups = {False: (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(),
                      ps.get_tensor_model_parallel_rank()),
              True: (ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size(),
                     ps.get_expert_tensor_parallel_rank())}
    ep_size, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    experts_per_rank = int(getattr(converter, "num_experts", 0) or 0) // ep_size
    env = {"dims": converter.dims(), "vocab": hf_config.vocab_size, "strict": strict}
    rules = [(r, r.compile()) for r in converter.rules()]

    owned: dict[str, torch.Tensor] = {}
    copies: dict[str, torch.Tensor] = {}  # tied copies: checked against their owners, never exported
    for name, param in _named_params(model_chunks):
        mapping, targets = _rule_for(rules, name, experts_per_rank, ep_rank)
        group, size, rank = groups[isinstance(mapping, ExpertTP)]
        tensors = _canonical(mapping, _gather(param, group, size), targets, env)
        if rank == 0:  # the group's other ranks computed the same tensors
            (copies if isinstance(mapping, Tied) else owned).update(
                {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()})

    payload = {"pp": ps.get_pipeline_model_parallel_rank(), "dp": ps.get_data_parallel_rank(with_context_parallel=True),
               "owned": owned, "copies": copies}
    received = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(payload, received, dst=0)
    if dist.get_rank() != 0:
        return None

    result: dict[str, torch.Tensor] = {}
    for item in received:
        for name, tensor in item["owned"].items():
            if name not in result:
                result[name] = tensor
            elif strict and not _bits_equal(result[name], tensor):
                raise AssertionError(f"{name}: DP rank {item['dp']} (PP {item['pp']}) differs from another replica")
    if strict:
        for item in received:
            for name, tensor in item["copies"].items():
                if name not in result or not _bits_equal(tensor, result[name]):
                    raise AssertionError(f"tied copy of {name} (PP {item['pp']}) differs from the tensor it is tied to")
    return dict(sorted(result.items()))
