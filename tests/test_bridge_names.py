"""The converters' name rules against Megatron-Bridge's own mapping registries, parameter
by parameter, for the families NeMo RL trains (Llama, Qwen3, Qwen3-MoE), under the
Transformer Engine layer spec's names (what Megatron-Bridge builds) and the local spec's.

Oracle: `tests/support/bridge_mappings.py` prints each bridge's `mapping_registry()` (the
real Megatron-Bridge 0.3.1, imported in a subprocess with stand-ins for imports that need
Transformer Engine or omegaconf). Every Megatron name a bridge maps, for each layer and
expert of a small config, must be placed on the same Hugging Face tensors (q, k, v and
gate, up in the bridge's order); every name of ours must be the bridge's, or one the
bridge does not know, listed below with the reason.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys

import pytest
from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

from nemo_dcr import registry
from nemo_dcr.layout import ParallelLayout
from tests.support.launch import REPO, worker_env

if importlib.util.find_spec("megatron.bridge") is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError("megatron-bridge is missing: pip install --no-deps megatron-bridge==0.3.1 (see README)")
    pytest.skip("megatron-bridge is not installed (pip install --no-deps megatron-bridge==0.3.1)",
                allow_module_level=True)

LAYERS, EXPERTS = 2, 4
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False)
CONFIGS = {
    "llama": LlamaConfig(**SMALL),
    "qwen3": Qwen3Config(**SMALL),
    "qwen3_moe": Qwen3MoeConfig(**SMALL, moe_intermediate_size=32, num_experts=EXPERTS, num_experts_per_tok=2),
}
# Names our tables place that a bridge's registry does not map (the bridge has no such
# parameter for that family), with why ours do.
OURS_ONLY = {
    "self_attention.linear_qkv.bias": "QKV biases (Qwen2-style attention, which the Qwen2 converter inherits)",
    "self_attention.q_layernorm.weight": "QK-norm, shared with Qwen3 (the Llama bridge has none)",
    "self_attention.k_layernorm.weight": "QK-norm, shared with Qwen3 (the Llama bridge has none)",
}


@pytest.fixture(scope="module")
def bridge() -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.support.bridge_mappings", *CONFIGS], cwd=REPO,
                          env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _targets(hf) -> list[str]:
    """A mapping's Hugging Face names in the bridge's order (q, k, v; gate, up)."""
    if isinstance(hf, str):
        return [hf]
    return [hf[k] for k in (("q", "k", "v") if "q" in hf else ("gate", "up"))]


def _concrete(mapping: dict):
    """(Megatron name, Hugging Face names) for every layer and expert a "*" stands for."""
    ranges = [range(LAYERS), range(EXPERTS)][:mapping["megatron"].count("*")]  # a layer, then an expert
    for index in itertools.product(*ranges):
        name, hf = mapping["megatron"], _targets(mapping["hf"])
        for i in index:
            name = name.replace("*", str(i), 1)
            hf = [h.replace("*", str(i), 1) for h in hf]
        yield name, hf


def _our_names(family: str):
    converter = registry.converter(family, CONFIGS[family])
    for rule, _ in converter._rules:
        for layer, expert in itertools.product(range(LAYERS), range(EXPERTS)):
            name = rule.pattern.replace("{L}", str(layer)).replace("{E}", str(expert))
            yield name


@pytest.mark.parametrize("family", list(CONFIGS))
def test_every_bridge_name_lands_where_the_bridge_puts_it(bridge, family):
    converter = registry.converter(family, CONFIGS[family])
    checked = []
    for mapping in bridge["families"][family]:
        for name, want in _concrete(mapping):
            _, got = converter.match(name, ParallelLayout())
            assert list(got) == want, f"{family}: {name} -> {list(got)}, Megatron-Bridge: {want}"
            checked.append(name)
    assert len(set(checked)) == len(checked) >= 10
    # the Transformer Engine spec's fused pre-norms are among them
    assert any(n.endswith("linear_qkv.layer_norm_weight") for n in checked)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_every_name_of_ours_is_the_bridges_or_unknown_to_it(bridge, family):
    patterns = [(re.compile("^" + re.escape(m["megatron"]).replace(r"\*", r"(\d+)") + "$"), m)
                for m in bridge["families"][family]]
    converter = registry.converter(family, CONFIGS[family])
    for name in set(_our_names(family)):
        hits = [(rx.match(name), m) for rx, m in patterns if rx.match(name)]
        if not hits:
            assert any(name.endswith(k) for k in OURS_ONLY), f"{family}: {name} is unknown to Megatron-Bridge"
            continue
        match, mapping = hits[0]
        want = _targets(mapping["hf"])
        for i in match.groups():
            want = [h.replace("*", i, 1) for h in want]
        assert list(converter.match(name, ParallelLayout())[1]) == want, name
