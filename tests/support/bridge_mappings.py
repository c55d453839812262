"""Megatron-Bridge's own parameter-name mapping registries, printed as JSON (the oracle of
tests/test_bridge_names.py; run in a subprocess, since the stand-ins below stay loaded).

    python -m tests.support.bridge_mappings llama qwen3 qwen3_moe

For each family: every mapping of its bridge's `mapping_registry()` as
{"kind", "megatron", "hf"}: a Megatron-core name pattern ("*" for a layer or expert
index) and the Hugging Face name(s) it maps to (a string; {"q","k","v"}; {"gate","up"}).

Megatron-Bridge (`pip install --no-deps megatron-bridge==0.3.1`: its declared dependencies
pin Transformer Engine and transformers<5) is imported on a CPU without Transformer
Engine. The stand-ins, each for an import the mapping tables do not use:
- the package `__init__`s of `megatron.bridge`, `megatron.bridge.models` and
  `megatron.bridge.models.llama` are skipped (empty packages over the real folders): they
  import every model family and the whole conversion stack, which ends in
  `import transformer_engine.pytorch`;
- `megatron.bridge.peft.lora` / `canonical_lora` (Transformer Engine at import) and
  `megatron.bridge.utils.instantiate_utils` / `megatron.bridge.models.config` (omegaconf
  at import) are replaced by the few names the bridge base classes refer to.
Transformer Engine itself is not faked: megatron-core would then take its TE paths.
"""

from __future__ import annotations

import enum
import json
import os
import sys
import types

BRIDGES = {
    "llama": ("megatron.bridge.models.llama.llama_bridge", "LlamaBridge"),
    "qwen3": ("megatron.bridge.models.qwen.qwen3_bridge", "Qwen3Bridge"),
    "qwen3_moe": ("megatron.bridge.models.qwen.qwen3_moe_bridge", "Qwen3MoEBridge"),
}


def _stand_ins() -> None:
    import megatron
    import megatron.core  # noqa: F401 - the real megatron-core first
    import torch.nn as nn

    root = next((os.path.join(p, "bridge") for p in megatron.__path__
                 if os.path.isdir(os.path.join(p, "bridge", "models", "conversion"))), None)
    if root is None:
        raise SystemExit("megatron-bridge is not installed (pip install --no-deps megatron-bridge==0.3.1)")

    def package(name: str, folder: str) -> None:
        m = types.ModuleType(name)
        m.__path__, m.__package__ = [folder], name
        sys.modules[name] = m

    package("megatron.bridge", root)
    for sub in ("models", "models/conversion", "models/llama", "models/qwen", "models/hf_pretrained", "peft",
                "utils"):
        package("megatron.bridge." + sub.replace("/", "."), os.path.join(root, sub))

    def module(name: str, **names) -> None:
        m = types.ModuleType(name)
        m.__dict__.update(names)
        sys.modules[name] = m

    class ModuleDict(nn.ModuleDict):
        """What the bridge checks instances against (canonical LoRA adapters)."""

    class LoRAMerge:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("LoRA merging needs Transformer Engine")

    class InstantiationMode(enum.Enum):
        STRICT = "strict"
        LENIENT = "lenient"

    def needs_omegaconf(*args, **kwargs):
        raise RuntimeError("needs omegaconf")

    module("megatron.bridge.peft.canonical_lora", ModuleDict=ModuleDict)
    module("megatron.bridge.peft.lora", LoRAMerge=LoRAMerge)
    module("megatron.bridge.utils.instantiate_utils", InstantiationMode=InstantiationMode)
    module("megatron.bridge.models.config", from_hf_pretrained=needs_omegaconf, save_hf_pretrained=needs_omegaconf)


def mappings(family: str) -> list[dict]:
    import importlib

    module, cls = BRIDGES[family]
    registry = getattr(importlib.import_module(module), cls)().mapping_registry()
    return [{"kind": type(m).__name__, "megatron": m.megatron_param, "hf": m.hf_param}
            for m in registry.get_all_mappings()]


def main(argv: list[str]) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    _stand_ins()
    from megatron.bridge.package_info import __version__

    print(json.dumps({"version": __version__, "families": {f: mappings(f) for f in argv or BRIDGES}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
