"""Models trained under their canonical names (plain PyTorch / Hugging Face trainers).

Every parameter is its canonical tensor: one piece per parameter, ownership split
across data-parallel ranks by the capture (see `nemo_dcr.capture.torch_owned_ranges`).

`rules` lists exceptions: parameters stored differently in training, e.g. a norm kept
zero-centred through `torch.nn.utils.parametrize` (trained as
"model.norm.parametrizations.weight.original", checkpoint "model.norm.weight" = 1 + w):
`Rule("model.norm.parametrizations.weight.original", ("model.norm.weight",), ZeroCenteredNorm())`.
A parameter that matches a rule is planned by its mapping; the rest are identity.
"""

from __future__ import annotations

from nemo_dcr import dtypes
from nemo_dcr.converter import Context, Converter, Rule, plan_param
from nemo_dcr.errors import ConverterError
from nemo_dcr.placement import AffineMap, Piece


class IdentityConverter(Converter):
    family = "identity"

    def __init__(self, hf_config, *, rules: list[Rule] | tuple[Rule, ...] = ()):
        super().__init__(hf_config)
        self._rules = [(r, r.compile()) for r in rules]
        for r in rules:
            if len(r.targets) != r.mapping.n_targets:
                raise ConverterError(f"rule {r.pattern!r}: {type(r.mapping).__name__} takes {r.mapping.n_targets} targets")

    def _match(self, name: str):
        hits = [(r, m) for r, rx in self._rules if (m := rx.match(name))]
        if len(hits) > 1:
            raise ConverterError(f"parameter {name!r} matches {len(hits)} rules: {[r.pattern for r, _ in hits]}")
        if not hits:
            return None
        rule, m = hits[0]
        targets = []
        for t in rule.targets:
            for key, value in m.groupdict().items():
                t = t.replace("{" + key + "}", value)
            targets.append(t)
        return rule, tuple(targets)

    def plan(self, params, layout, specs, *, loading=False):
        maps = {}
        for p in params:
            hit = self._match(p.name)
            if hit is not None:
                rule, targets = hit
                maps[p.name] = plan_param(rule.mapping, Context(p, layout, targets, specs, None), loading=loading)
                continue
            if p.name not in specs:
                raise ConverterError(f"parameter {p.name!r} is not a tensor of the canonical checkpoint")
            dtype, shape = specs[p.name]
            if tuple(shape) != tuple(p.local_shape):
                raise ConverterError(f"parameter {p.name!r} has shape {tuple(p.local_shape)}, checkpoint {tuple(shape)}")
            if dtypes.from_name(dtype).torch_dtype != p.dtype:
                raise ConverterError(f"parameter {p.name!r} is {p.dtype}, checkpoint {dtype}: not a bit copy")
            maps[p.name] = AffineMap(p.name, p.numel, (Piece(p.name, 0, 1, p.numel, 0, 0),) if p.numel else ())
        return maps
