"""Models trained under their canonical names (plain PyTorch / Hugging Face trainers).

Every parameter is its canonical tensor: one piece per parameter, ownership split
across data-parallel ranks by the capture (see `nemo_dcr.capture.torch_owned_ranges`).
"""

from __future__ import annotations

from nemo_dcr import dtypes
from nemo_dcr.converter import Converter
from nemo_dcr.errors import ConverterError
from nemo_dcr.placement import AffineMap, Piece


class IdentityConverter(Converter):
    family = "identity"

    def plan(self, params, layout, specs, *, loading=False):
        maps = {}
        for p in params:
            if p.name not in specs:
                raise ConverterError(f"parameter {p.name!r} is not a tensor of the canonical checkpoint")
            dtype, shape = specs[p.name]
            if tuple(shape) != tuple(p.local_shape):
                raise ConverterError(f"parameter {p.name!r} has shape {tuple(p.local_shape)}, checkpoint {tuple(shape)}")
            if dtypes.from_name(dtype).torch_dtype != p.dtype:
                raise ConverterError(f"parameter {p.name!r} is {p.dtype}, checkpoint {dtype}: not a bit copy")
            maps[p.name] = AffineMap(p.name, p.numel, (Piece(p.name, 0, 1, p.numel, 0, 0),) if p.numel else ())
        return maps
