"""Find converters and transports by name: the entry points of the installed distributions.

Groups: `nemo_dcr.converters` and `nemo_dcr.transports`. This package declares its own in
pyproject.toml, a third party in its package's metadata; both are read the same way, so
NeMo-DCR itself must be installed (`pip install -e .` in a source checkout).
"""

from __future__ import annotations

import re
from importlib.metadata import entry_points

from nemo_dcr.errors import ConverterError, NotInstalled

CONVERTERS, TRANSPORTS = "nemo_dcr.converters", "nemo_dcr.transports"
_DISTRIBUTION = "nemo-dcr"


def _ours(ep) -> bool:
    return ep.dist is not None and re.sub(r"[-_.]+", "-", ep.dist.name).lower() == _DISTRIBUTION


def _entry_points(group: str):
    found = entry_points()
    # Without the package's metadata even its own converters and transports cannot be found.
    if not any(_ours(ep) for g in (CONVERTERS, TRANSPORTS) for ep in found.select(group=g)):
        raise NotInstalled(f"no entry points of the {_DISTRIBUTION} distribution: NeMo-DCR is not installed in "
                           "this environment (from a source checkout: pip install -e .)")
    return found.select(group=group)


def available(group: str) -> list[str]:
    return sorted({ep.name for ep in _entry_points(group)})


def load(group: str, name: str):
    for ep in _entry_points(group):
        if ep.name == name:
            return ep.load()
    kind = group.rsplit(".", 1)[-1].rstrip("s")
    raise KeyError(f"no {kind} named {name!r}; available: {available(group)}")


def transport(name: str, config: dict | None = None, *, receivers: list[str] | None = None):
    """Build a transport by name from its configuration."""
    return load(TRANSPORTS, name)(config, receivers=receivers)


def converter(name: str, hf_config, **options):
    """Build a family's converter by name for a Hugging Face config; `options` go to its
    constructor (e.g. `qkv_as_residual=True` for the llama / qwen3 table)."""
    return load(CONVERTERS, name)(hf_config, **options)


def converter_for(hf_config, names, *, canonical=None, **options):
    """The converter a model's own parameter names call for.

    `names`: the trainer's parameter names. All of them canonical checkpoint names: the
    `identity` converter. All mapped by the converter registered under
    `hf_config.model_type` (Megatron names): that converter, built with `options`.
    Otherwise a `ConverterError` names a few of the unmatched names and the available
    converters. `canonical`: the checkpoint's tensor names (e.g. `read_specs(dir)`); by
    default those of the transformers model of `hf_config` (its `architectures`, else a
    causal LM), built on the meta device.
    """
    names = list(names)
    model_type = getattr(hf_config, "model_type", None)
    family = None
    if model_type in available(CONVERTERS):
        family = converter(model_type, hf_config, **options)
        if names and all(family.has_rule(n) for n in names):
            return family
    known = set(_hf_names(hf_config) if canonical is None else canonical)
    if names and all(n in known for n in names):
        return converter("identity", hf_config)
    unmatched = [n for n in names if n not in known and not (family is not None and family.has_rule(n))]
    why = (f"nor mapped by the {model_type!r} converter" if family else
           f"and no converter is registered under model_type {model_type!r}")
    raise ConverterError(
        f"no converter fits these parameter names: {len(unmatched)} of {len(names)} are neither canonical checkpoint "
        f"names {why}, e.g. {unmatched[:4]}; available converters: {available(CONVERTERS)}")


def _hf_names(hf_config) -> list[str]:
    """State-dict names of the transformers model of `hf_config` (no memory: meta device)."""
    import torch
    import transformers

    archs = getattr(hf_config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    with torch.device("meta"):
        model = cls(hf_config) if cls is not None else transformers.AutoModelForCausalLM.from_config(hf_config)
    return list(model.state_dict())


def demo_families() -> list[str]:
    """Converter names `nemo-dcr demo` can build a model of (see `Converter.demo_config`)."""
    return [n for n in available(CONVERTERS) if n in load(CONVERTERS, n).demo_model_types]


def demo_config(name: str, **sizes):
    """A small transformers config of family `name` for the demo: `Converter.demo_config`'s sizes."""
    config = load(CONVERTERS, name).demo_config(name, **sizes)
    if config is None:
        raise KeyError(f"converter {name!r} describes no demo model; demo families: {demo_families()}")
    return config
