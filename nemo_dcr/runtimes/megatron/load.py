"""Load a canonical checkpoint into Megatron shards through a converter's affine maps.

The same pieces that place changes at refit time place the checkpoint at start-up
(with `loading=True`, so replicas and tied copies are filled too): a strided view
of each canonical tensor is copied into each local block. Local elements no piece
covers (vocab padding) are zeroed.
"""

from __future__ import annotations

import torch

from nemo_dcr.placement import AffineMap


@torch.no_grad()
def load_into(params: dict[str, torch.nn.Parameter], maps: dict[str, AffineMap], read) -> None:
    """Fill every local parameter from canonical tensors; `read(name)` returns one."""
    cache: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        amap = maps[name]
        flat = param.data.view(-1)
        if amap.covered < flat.numel():
            flat.zero_()
        needed = {p.canonical for p in amap.pieces}
        for stale in set(cache) - needed:  # keep only what this parameter reads: memory stays flat
            del cache[stale]
        for p in amap.pieces:
            if p.canonical not in cache:
                cache[p.canonical] = read(p.canonical).reshape(-1)
            src = cache[p.canonical]
            if src.dtype != param.dtype:
                raise TypeError(f"{name}: canonical {p.canonical} is {src.dtype}, parameter is {param.dtype}")
            block = src.as_strided((p.rows, p.cols), (p.row_stride, 1), p.offset)
            flat[p.local_start:p.local_stop].view(p.rows, p.cols).copy_(block)
