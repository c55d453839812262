"""Find converters and transports by name (entry points, so third parties plug in).

Groups: `nemo_dcr.converters` and `nemo_dcr.transports`. A name that no installed
distribution registers falls back to the module of the same name shipped here
(`nemo_dcr.converters.<name>` / `nemo_dcr.transports.<name>`), so a source checkout
works before it is installed.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

_FALLBACK = {
    "nemo_dcr.converters": {"llama": "nemo_dcr.converters.llama:LlamaConverter",
                            "qwen3": "nemo_dcr.converters.llama:LlamaConverter",
                            "identity": "nemo_dcr.converters.identity:IdentityConverter",
                            "qwen2": "nemo_dcr.converters.qwen2:Qwen2Converter",
                            "qwen3_moe": "nemo_dcr.converters.qwen3_moe:Qwen3MoeConverter",
                            "mixtral": "nemo_dcr.converters.mixtral:MixtralConverter",
                            "llama-qkv-residual": "nemo_dcr.converters.llama:LlamaQKVResidualConverter",
                            "qwen3-qkv-residual": "nemo_dcr.converters.llama:LlamaQKVResidualConverter",
                            "llama-fp8": "nemo_dcr.converters.llama:LlamaFP8Converter",
                            "qwen3-fp8": "nemo_dcr.converters.llama:LlamaFP8Converter"},
    "nemo_dcr.transports": {"local": "nemo_dcr.transports.local:LocalTransport",
                            "relay": "nemo_dcr.transports.relay:RelayTransport",
                            "s3": "nemo_dcr.transports.s3:S3Transport"},
}


def available(group: str) -> list[str]:
    return sorted({ep.name for ep in entry_points(group=group)} | set(_FALLBACK.get(group, {})))


def load(group: str, name: str):
    for ep in entry_points(group=group):
        if ep.name == name:
            return ep.load()
    target = _FALLBACK.get(group, {}).get(name)
    if target is None:
        kind = group.rsplit(".", 1)[-1].rstrip("s")
        raise KeyError(f"no {kind} named {name!r}; available: {available(group)}")
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def transport(name: str, config: dict | None = None, *, receivers: list[str] | None = None):
    """Build a transport by name from its configuration."""
    return load("nemo_dcr.transports", name)(config, receivers=receivers)


def converter(name: str, hf_config, **options):
    """Build a family's converter by name for a Hugging Face config; `options` go to its
    constructor (e.g. `qkv_as_residual=True` for the llama / qwen3 table)."""
    return load("nemo_dcr.converters", name)(hf_config, **options)
