"""The README's training loops run exactly as printed (a doc edit that breaks one fails
here): the plain PyTorch one in a single process, the Megatron one on two TP ranks under
torchrun with a `nemo-dcr receive` process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.launch import REPO, torchrun


def readme_block(heading: str) -> str:
    """The first ```python block under `heading` in README.md."""
    text = (REPO / "README.md").read_text()
    section = text.split(heading, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python block under {heading!r}"
    return match.group(1)


def test_the_plain_pytorch_loop_runs_as_printed(tmp_path):
    code = readme_block("### A plain PyTorch trainer")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    steps = re.findall(r"step (\d): ([\d.]+)% changed, (\d+) wire bytes", out.stdout)
    assert [s[0] for s in steps] == ["0", "1", "2"], out.stdout
    assert all(float(rate) > 0 and int(wire) > 0 for _, rate, wire in steps)


def test_the_megatron_loop_runs_as_printed(tmp_path, monkeypatch):
    from nemo_dcr.cli import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "v0", family="qwen3", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128,
                           vocab=256, seed=3)
    # the block starts `nemo-dcr receive`: the console script of this interpreter's environment
    monkeypatch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    out = torchrun(2, REPO / "tests" / "workers" / "readme_megatron.py", str(ckpt), str(tmp_path / "work"),
                   ok_marker="[readme-megatron] OK")
    steps = re.findall(r"step (\d): ([\d.]+)% changed, (\d+) wire bytes", out)
    assert [s[0] for s in steps] == ["0", "1", "2"], out[-3000:]
    assert all(float(rate) > 0 and int(wire) > 0 for _, rate, wire in steps)
    assert "[rx0] shut down at version 3" in out
    assert not (tmp_path / "work" / "shm").exists() or not any((tmp_path / "work" / "shm").iterdir())
