"""Megatron ranks under torchrun refit real HF receiver processes over the local
transport; after every step each receiver must equal a dense canonical export of
the trainer (digests of every tensor), and after the last step the full states are
compared element by element."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(["--tp", "2", "--dp", "2", "--pp", "1", "--family", "qwen3"], id="tp2-dp2-distopt-qwen3"),
        pytest.param(["--tp", "2", "--dp", "1", "--pp", "2", "--family", "llama", "--tied"], id="tp2-pp2-llama-tied"),
    ],
)
def test_refit_is_bit_exact_after_every_step(tmp_path, layout):
    steps = 3
    cmd = [sys.executable, "-m", "nemo_dcr.cli", "demo", "--steps", str(steps), "--receivers", "1",
           "--layers", "4", "--hidden", "128", "--lr", "1e-5", "--workdir", str(tmp_path / "run"),
           "--shm-dir", str(tmp_path / "shm"), "--timeout", "180", "--dump", *layout]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    results = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert [r["step"] for r in results] == [1, 2, 3], out[-3000:]
    for r in results:
        assert r["committed"] and r["bit_exact"], r
        assert 0 < r["change_rate"] < 0.5 and r["wire_bytes"] < r["dense_bytes"], r
    assert results[-1]["version"] == steps
    assert "final state of rx0 vs dense export, element by element: identical" in out, out[-3000:]
    assert not (tmp_path / "shm").exists()  # the transport's shared memory is gone
