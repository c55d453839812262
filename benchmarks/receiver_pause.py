"""One receiver's pause (the in-place apply), on one thread and on the receiver's cores.

    python benchmarks/receiver_pause.py              # ~2 min: the 1.07B end-to-end model, 3% and 5%
    python benchmarks/receiver_pause.py --smoke      # seconds: a tiny model (CI smoke)

The model of benchmarks/e2e_link.py (a random-init Qwen3-style BF16 model, 1.07B
parameters) is held by an `HFRuntime`, as `nemo-dcr receive` holds it. Each rate's
records are what two producers send: each owns half of every tensor, moves --rate of its
elements by ±1 ULP (add records, the default op's choice for such steps), and cuts its
payloads at 2**21 changes, the first at a sixteenth of that. A pause is what the receiver
does once every payload is staged: one `batch()`, one `apply` per payload. Rounds
alternate the thread counts (`apply_threads`: 1, then each of --threads), and each round
applies the inverse of the one before, so the weights come back and every round writes the
same lines. Before timing, the bits after an apply with each thread count are compared
with one thread's. Reported per rate and thread count: every round's pause, min and median,
and the median against one thread's. Results: benchmarks/results/receiver_pause.json and
.png (--smoke: receiver_pause_smoke.* in the temp dir; or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.outputs import results_path  # noqa: E402
from benchmarks.qwen3_shapes import qwen3_dims  # noqa: E402

PAYLOAD = 1 << 21  # the end-to-end producers' max_payload_elements


def log(msg: str) -> None:
    print(f"[pause] {msg}", flush=True)


def make_runtime(hidden: int, layers: int, vocab: int, apply_threads: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from nemo_dcr.runtimes.hf import HFRuntime

    config = Qwen3Config(**qwen3_dims(hidden, layers, vocab), tie_word_embeddings=False,
                         max_position_embeddings=1024)
    torch.manual_seed(0)
    with torch.no_grad():
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    return HFRuntime(model, apply_threads=apply_threads)


def payloads(runtime, rate: float, seed: int, producers: int = 2) -> list[list]:
    """Every producer's payloads (lists of records), in the order they would arrive."""
    from nemo_dcr.records import Op, Record

    rng = np.random.default_rng(seed)
    out = []
    for p in range(producers):
        current, held, first = [], 0, True
        for name, (dtype, shape) in runtime.catalog().items():
            numel = int(np.prod(shape))
            lo, hi = numel * p // producers, numel * (p + 1) // producers
            pos = lo + np.flatnonzero(rng.random(hi - lo, dtype=np.float32) < rate).astype(np.int64)
            vals = rng.choice(np.array([1, 0xFFFF], np.uint16), pos.size)
            while pos.size:  # cut where the producer cuts a payload
                take = min(pos.size, (PAYLOAD // 16 if first else PAYLOAD) - held)
                current.append(Record(name, dtype, tuple(shape), Op.ADD, pos[:take].astype(np.uint32), vals[:take]))
                pos, vals, held = pos[take:], vals[take:], held + take
                if held >= (PAYLOAD // 16 if first else PAYLOAD):
                    out.append(current)
                    current, held, first = [], 0, False
        if current:
            out.append(current)
    return out


def pause(runtime, staged: list[list]) -> tuple[float, list]:
    t = time.perf_counter()
    with runtime.batch():
        logs = [runtime.apply(records) for records in staged]
    return time.perf_counter() - t, logs


def inverse_payloads(staged: list[list]) -> list[list]:
    from nemo_dcr.runtimes.base import inverse

    return [[inverse(r) for r in records] for records in staged]


def digest(runtime) -> str:
    from nemo_dcr.verify import state_digests

    return json.dumps(state_digests(runtime.canonical_state()), sort_keys=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rates", default="0.03,0.05")
    ap.add_argument("--threads", default="0", help="thread counts beside 1, comma-separated; 0: the cores "
                                                  "this process may use, at most 8 (HFRuntime's default)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per thread count and rate")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, seconds")
    ap.add_argument("--out", help="results JSON (default benchmarks/results/receiver_pause.json; with --smoke, "
                                  "the temp dir); the PNG beside it")
    args = ap.parse_args(argv)
    from nemo_dcr.runtimes import scatter

    try:
        counts = sorted({scatter.resolve_threads(int(x) or None) for x in args.threads.split(",")} - {1})
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError as e:
        ap.error(f"--threads takes integers >= 0 and --rates numbers, comma-separated: {e}")
    if not all(0 < r < 1 for r in rates) or args.rounds < 1:
        ap.error("--rates must lie in (0, 1) and --rounds be at least 1")
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.rounds = 128, 2, 512, 2
    if not counts:
        log("one core only: the pause runs on one thread here, so there is nothing to compare")
    t = time.perf_counter()
    runtime = make_runtime(args.hidden, args.layers, args.vocab, 1)
    params = sum(p.numel() for p in runtime.model.parameters())
    log(f"model: {params / 1e9:.3f}B params in {time.perf_counter() - t:.1f} s; thread counts 1 and {counts}")
    rows = []
    for k, rate in enumerate(rates):
        staged = payloads(runtime, rate, seed=k)
        undo = inverse_payloads(staged)
        changes = sum(len(r) for records in staged for r in records)
        log(f"{rate:.0%}: {changes / 1e6:.1f}M changes in {len(staged)} payloads")
        # the same bits with every thread count (also the first apply: loader plans, first touches)
        runtime.apply_threads = 1
        pause(runtime, staged)
        want = digest(runtime)
        pause(runtime, undo)
        for n in counts:
            runtime.apply_threads = n
            pause(runtime, staged)
            if digest(runtime) != want:
                raise SystemExit(f"{rate:.0%}: {n} apply threads gave other bits than one")
            pause(runtime, undo)
        times = {n: [] for n in [1, *counts]}
        forward = True
        for r in range(args.rounds):
            for n in times:
                runtime.apply_threads = n
                times[n].append(pause(runtime, staged if forward else undo)[0])
                forward = not forward
            log(f"    round {r + 1}/{args.rounds}: " + ", ".join(f"{n} thread(s) {times[n][-1] * 1e3:.0f} ms"
                                                           for n in times))
        if not forward:
            pause(runtime, undo)  # leave the weights as they were for the next rate
        one = statistics.median(times[1])
        for n, ts in times.items():
            rows.append({"rate": rate, "threads": n, "changes": changes, "payloads": len(staged),
                         "pause_s": ts, "min_s": min(ts), "median_s": statistics.median(ts),
                         "median_over_one_thread": statistics.median(ts) / one,
                         "ns_per_change": statistics.median(ts) / changes * 1e9})
            log(f"    {n} thread(s): median {statistics.median(ts) * 1e3:.1f} ms (min {min(ts) * 1e3:.1f}), "
                f"{statistics.median(ts) / one:.2f}x one thread's, {rows[-1]['ns_per_change']:.2f} ns a change")
    result = {"benchmark": "receiver_pause", "smoke": args.smoke, "params": params, "rounds": args.rounds,
              "rows": rows, "bit_exact": True, "machine": machine_info()}
    path = results_path("receiver_pause", args.out, args.smoke)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    plot(result, path.with_suffix(".png"))
    log(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{r['rate']:.0%}\n{r['threads']} thread(s)" for r in rows]
    ax.bar(labels, [r["median_s"] * 1e3 for r in rows], color=["#999" if r["threads"] == 1 else "#4a7" for r in rows])
    ax.set_ylabel("pause, ms (median)")
    ax.set_title(f"one receiver's in-place apply, {result['params'] / 1e9:.2f}B params", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
