"""The registry: names come only from entry points, a missing install is named, and
`converter_for` picks the converter a model's own parameter names call for."""

from __future__ import annotations

from importlib.metadata import EntryPoint, EntryPoints

import pytest
import torch
import transformers

from nemo_dcr import registry
from nemo_dcr.converters.identity import IdentityConverter
from nemo_dcr.converters.llama import LlamaConverter
from nemo_dcr.converters.qwen3_moe import Qwen3MoeConverter
from nemo_dcr.errors import ConverterError, NotInstalled

SIZES = dict(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=100, tied=False, experts=4)


def test_names_come_from_this_package_entry_points():
    converters = set(registry.available(registry.CONVERTERS))
    assert {"identity", "llama", "qwen3", "qwen2", "qwen3_moe", "mixtral"} <= converters
    assert registry.available(registry.TRANSPORTS) == ["local", "relay", "s3"]
    with pytest.raises(KeyError, match=r"no converter named 'lama'; available: \['identity'"):
        registry.load(registry.CONVERTERS, "lama")


@pytest.mark.parametrize("found", [[], [EntryPoint("phi3", "phi3_family:Phi3Converter", registry.CONVERTERS)]],
                         ids=["nothing", "a-third-party-only"])
def test_without_this_package_metadata_the_error_says_install_it(monkeypatch, found):
    monkeypatch.setattr(registry, "entry_points", lambda: EntryPoints(found))
    with pytest.raises(NotInstalled, match=r"NeMo-DCR is not installed .*pip install -e \."):
        registry.converter("llama", None)
    with pytest.raises(NotInstalled):
        registry.available(registry.TRANSPORTS)


def hf_names(config) -> list[str]:
    with torch.device("meta"):
        return [n for n, _ in transformers.AutoModelForCausalLM.from_config(config).named_parameters()]


MEGATRON_DENSE = ["embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
                  "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.1.mlp.linear_fc1.weight",
                  "decoder.layers.1.self_attention.q_layernorm.weight", "decoder.final_layernorm.weight",
                  "output_layer.weight"]


def test_canonical_names_choose_identity():
    config = registry.demo_config("qwen3", **SIZES)
    names = hf_names(config)
    assert "model.layers.1.self_attn.q_proj.weight" in names
    assert isinstance(registry.converter_for(config, names), IdentityConverter)
    assert isinstance(registry.converter_for(config, names[:3], canonical=names), IdentityConverter)


def test_megatron_names_choose_the_model_type_converter():
    dense = registry.converter_for(registry.demo_config("qwen3", **SIZES), MEGATRON_DENSE, qkv_as_residual=True)
    assert type(dense) is LlamaConverter and dense.qkv_as_residual
    moe = registry.converter_for(registry.demo_config("qwen3_moe", **SIZES), [
        "decoder.layers.0.mlp.router.weight", "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight",
        "decoder.layers.0.self_attention.linear_proj.weight"])
    assert isinstance(moe, Qwen3MoeConverter)


def test_names_that_fit_no_converter_are_named():
    config = registry.demo_config("llama", **SIZES)
    mixed = [*MEGATRON_DENSE[:2], "model.layers.0.mlp.up_proj.weight", "transformer.h.0.attn.c_attn.weight"]
    with pytest.raises(ConverterError, match=r"2 of 4 are neither canonical checkpoint names nor mapped by the "
                                             r"'llama' converter, e.g. \['model.layers.0.mlp.up_proj.weight', "
                                             r"'transformer.h.0.attn.c_attn.weight'\]; available converters: \["):
        registry.converter_for(config, mixed, canonical=["model.layers.0.mlp.down_proj.weight"])
    config.model_type = "gpt2"  # no converter registered under it
    with pytest.raises(ConverterError, match=r"no converter is registered under model_type 'gpt2'"):
        registry.converter_for(config, MEGATRON_DENSE, canonical=[])


def test_demo_families_are_the_converters_that_describe_a_demo_model():
    assert registry.demo_families() == ["llama", "mixtral", "qwen2", "qwen3", "qwen3_moe"]
    moe = registry.demo_config("mixtral", **SIZES)
    assert (moe.model_type, moe.num_local_experts, moe.intermediate_size) == ("mixtral", 4, 64)
    with pytest.raises(KeyError, match=r"converter 'qwen3-fp8' describes no demo model; demo families: \['llama'"):
        registry.demo_config("qwen3-fp8", **SIZES)
