"""Benchmarks are not tests; this only checks, in seconds, that each one still runs and
writes its results."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.launch import REPO, worker_env


def test_transport_benchmark_smoke(tmp_path):
    out = tmp_path / "transports.json"
    proc = subprocess.run([sys.executable, "benchmarks/transports.py", "--smoke", "--receivers", "1",
                           "--transports", "local,relay,s3", "--out", str(out)],
                          cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert {r["transport"] for r in rows} == {"local", "relay", "s3"}
    assert all(r["best_s"] > 0 and r["receivers"] == 1 for r in rows)
