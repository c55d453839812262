"""Load a canonical checkpoint into Megatron shards through a converter's maps.

The same pieces that place changes at refit time place the checkpoint at start-up
(with `loading=True`, so replicas and tied copies are filled too): a strided view
of each canonical tensor is copied into each local block. Local elements no piece
covers (vocab padding) are zeroed.

A residual parameter (`ResidualMap`) is filled through its rule's inverse: the
canonical slices its shard holds are read into the outputs, and `inverse(outputs)`
gives the local parameter. The round trip is then checked: `forward` of what was
loaded must give back the checkpoint's bits, because the producers take `forward`
of the loaded parameters as the residual baseline, i.e. as what receivers hold.

`names` restricts a load to some canonical tensors of a model that already holds
the rest (a Megatron-inference receiver runs the loader this way under the
interception engine, `nemo_dcr.runtimes.megatron.receiver`): only their pieces are
copied and no other element is written, vocab padding included (zeroing it is part
of the initial load only). A residual parameter that reads any of them is reloaded
whole, reading its other targets through `read` as well.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from nemo_dcr import dtypes
from nemo_dcr.errors import ConverterError
from nemo_dcr.placement import AffineMap, ResidualMap


@torch.no_grad()
def load_into(params: dict[str, torch.nn.Parameter], maps: dict[str, AffineMap | ResidualMap], read,
              *, names: Collection[str] | None = None) -> None:
    """Fill every local parameter from canonical tensors; `read(name)` returns one.

    names: load only the pieces of these canonical tensors (see the module notes);
    None (default): everything, uncovered elements zeroed."""
    only = None if names is None else frozenset(names)
    cache: dict[str, torch.Tensor] = {}

    def canonical(name: str, needed: set[str]) -> torch.Tensor:
        for stale in set(cache) - needed:  # keep only what this parameter reads: memory stays flat
            del cache[stale]
        if name not in cache:
            cache[name] = read(name).reshape(-1)
        return cache[name]

    for name, param in params.items():
        amap = maps[name]
        if isinstance(amap, ResidualMap):
            if only is None or any(p.canonical in only for o in amap.outputs for p in o.pieces):
                _load_residual(name, param, amap, canonical)
            continue
        flat = param.data.view(-1)
        pieces = amap.pieces if only is None else [p for p in amap.pieces if p.canonical in only]
        if only is None and amap.covered < flat.numel():
            flat.zero_()
        needed = {p.canonical for p in pieces}
        for p in pieces:
            src = canonical(p.canonical, needed)
            if src.dtype != param.dtype:
                raise TypeError(f"{name}: canonical {p.canonical} is {src.dtype}, parameter is {param.dtype}")
            block = src.as_strided((p.rows, p.cols), (p.row_stride, 1), p.offset)
            flat[p.local_start:p.local_stop].view(p.rows, p.cols).copy_(block)


def _load_residual(name: str, param: torch.Tensor, rmap: ResidualMap, canonical) -> None:
    if rmap.inverse is None:
        raise ConverterError(f"{name}: the {rmap.kind} rule has no inverse, so a checkpoint cannot be loaded into it")
    needed = {p.canonical for o in rmap.outputs for p in o.pieces}
    outputs = []
    for out, dtype_name in zip(rmap.outputs, rmap.dtypes):
        buf = torch.zeros(out.numel, dtype=dtypes.from_name(dtype_name).torch_dtype)
        for p in out.pieces:
            src = canonical(p.canonical, needed)
            if src.dtype != buf.dtype:
                raise TypeError(f"{name}: canonical {p.canonical} is {src.dtype}, the {rmap.kind} expects {buf.dtype}")
            buf[p.local_start:p.local_stop].view(p.rows, p.cols).copy_(
                src.as_strided((p.rows, p.cols), (p.row_stride, 1), p.offset))
        outputs.append(buf)
    local = rmap.inverse(outputs)
    if tuple(local.shape) != tuple(param.shape) or local.dtype != param.dtype:
        raise ConverterError(f"{name}: the {rmap.kind} inverse gave {tuple(local.shape)} {local.dtype}, "
                             f"the parameter is {tuple(param.shape)} {param.dtype}")
    param.data.copy_(local)
    # Round trip on what was copied (the same bits as param now; under interception the
    # copy is only recorded). Only covered output elements are checkpoint values.
    for i, (again, want, out) in enumerate(zip(rmap.compute(local), outputs, rmap.outputs)):
        again, want = dtypes.bits_of(again.contiguous()), dtypes.bits_of(want)
        for p in out.pieces:
            bad = int((again[p.local_start:p.local_stop] != want[p.local_start:p.local_stop]).sum())
            if bad:
                raise ConverterError(
                    f"{name}: {bad} element(s) of {p.canonical} do not survive the {rmap.kind} round trip "
                    f"(forward(inverse(checkpoint)) != checkpoint): the trainer cannot hold these values, so "
                    f"receivers and the producers' residual baseline would disagree")
