"""The README's plain-PyTorch training loop runs exactly as printed (a doc edit that
breaks it fails here)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.launch import REPO


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
