"""A new model family from one file outside the package, found through its entry point
and refitted bit-exact, with nothing in the project edited.

The file is the Phi-3 example of docs/write-a-converter.md, as printed there (a doc edit
that breaks it fails here): a checkpoint with packed `qkv_proj` / `gate_up_proj`, declared
with the library's `PackedQKV` / `PackedGateUp`. It goes to a temporary folder beside a
hand-written `.dist-info` that declares the `nemo_dcr.converters` entry point, and that
folder goes on PYTHONPATH. A Megatron trainer (TP=2 x DP=2) then refits a Megatron-inference
job (PP=2) by `--family phi3`; both load the packed checkpoint through the file, and the
test oracle, which reads the file's rules, exports both after loading and after every step.

The checkpoint is a Llama checkpoint packed the Phi-3 way, with its Llama config: the
Megatron builder refuses `model_type: phi3`, and a Phi-3 with full rotary embedding and no
sliding window differs from a Llama only in that packing.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.support.launch import REPO, TORCHRUN_TIMEOUT_S, run
from tests.support.megatron_jobs import check_exports, trainer_refits_inference

pytestmark = pytest.mark.multirank


def doc_block(heading: str) -> str:
    """The first ```python block under `heading` in docs/write-a-converter.md."""
    section = (REPO / "docs" / "write-a-converter.md").read_text().split(heading, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python block under {heading!r}"
    return match.group(1)


@pytest.fixture()
def phi3_plugin(tmp_path, monkeypatch) -> Path:
    """A folder outside the package holding the family file and its distribution
    metadata, on PYTHONPATH (the workers' environment inherits it)."""
    plugin = tmp_path / "plugin"
    info = plugin / "phi3_family-0.1.dist-info"
    info.mkdir(parents=True)
    (plugin / "phi3_family.py").write_text(doc_block("### The file: `phi3_family.py`"))
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: phi3-family\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[nemo_dcr.converters]\nphi3 = phi3_family:Phi3Converter\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(plugin), os.environ.get("PYTHONPATH")])))
    return plugin


def packed_checkpoint(path: Path) -> Path:
    """A small Llama checkpoint whose q/k/v and gate/up are packed as Phi-3 packs them."""
    from safetensors.torch import load_file, save_file
    import torch

    from nemo_dcr.cli import make_checkpoint

    make_checkpoint(path, family="llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=300, seed=7)
    (file,) = path.glob("*.safetensors")
    state = load_file(file)
    for layer in range(2):
        attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        state[attn + "qkv_proj.weight"] = torch.cat([state.pop(attn + f"{x}_proj.weight") for x in "qkv"])
        state[mlp + "gate_up_proj.weight"] = torch.cat([state.pop(mlp + f"{x}_proj.weight") for x in ("gate", "up")])
    save_file(state, file, metadata={"format": "pt"})
    return path


REGISTRY_CHECK = """
from nemo_dcr import registry
print("converters", registry.available("nemo_dcr.converters"))
print("loaded", registry.load("nemo_dcr.converters", "phi3").__module__)
"""


@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 120)
def test_a_family_from_its_own_file_refits_bit_exact(tmp_path, phi3_plugin):
    rc, out = run([sys.executable, "-c", REGISTRY_CHECK], timeout=120)
    assert rc == 0 and "'phi3'" in out and "loaded phi3_family" in out, out[-3000:]

    steps, ckpt = 2, packed_checkpoint(tmp_path / "ckpt")
    trainer_out, rx_log, receivers = trainer_refits_inference(
        tmp_path, ckpt, trainer_ranks=4, trainer_args=["--family", "phi3", "--tp", "2", "--steps", str(steps)],
        inference_tp=1, inference_pp=2, inference_args=["--family", "phi3"])
    assert trainer_out.count("whole-held digests match") == steps, trainer_out[-3000:]
    assert "0 residual overwrites" in trainer_out, trainer_out[-3000:]  # every packed element placed affine
    check_exports(tmp_path, ckpt, receivers, steps)
