"""What the whole-state digest costs: once at load, and per refit on both ends.

    python benchmarks/digest_cost.py            # ~5 min: the 1.07B end-to-end model, 1%, 3%, 5%
    python benchmarks/digest_cost.py --smoke    # seconds: a tiny model (CI smoke)

The model is benchmarks/e2e_link.py's (a random-init Qwen3-style BF16 model, 1.07B
parameters), in one process:
- trainer side: one producer owning half of every tensor (data-parallel rank 0 of 2, as
  each of the end-to-end benchmark's two producers), diff + place + encode of one refit
  (`Producer.refit` into an end that only keeps the bytes), its changes ±1 ULP at --rates;
  each round runs the same refit with the digest kept and without, in alternating order;
- receiver side: one `HFRuntime` (as `nemo-dcr receive` holds the model) applying a
  refit's payloads (both producers', cut as they cut them) in one `batch()`, the pause,
  with the digest's move summed as it writes and without; each round applies the inverse
  of the one before, so every round writes the same lines;
- once: the receiver's digest of the whole model, read from its runtime, and the
  producer's digest of its share, placed element by element.
Every kept digest is checked against one read from the state afterwards. Reported per rate:
every round's seconds with and without, the medians and their ratio. Results:
benchmarks/results/digest_cost.json (--smoke: the temp dir; or --out).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.outputs import results_path  # noqa: E402
from benchmarks.qwen3_shapes import qwen3_shapes  # noqa: E402
from benchmarks.receiver_pause import inverse_payloads, make_runtime, payloads  # noqa: E402
from benchmarks.trainer_speed import KeepingEnd, perturb, setup_model  # noqa: E402


def log(msg: str) -> None:
    print(f"[digest] {msg}", flush=True)


def producer_side(args, rates: list[float]) -> dict:
    from nemo_dcr import digest
    from nemo_dcr.baseline import Baseline
    from nemo_dcr.sender import Producer
    from nemo_dcr.records import TransferInfo

    params, owned, maps, specs, _ = setup_model(qwen3_shapes(args.hidden, args.layers, args.vocab))
    end = KeepingEnd()
    baseline = Baseline()
    producer = Producer("p0", owned, maps, specs, baseline, end, max_payload_elements=1 << 21)
    share = sum(r.stop - r.start for r in producer.owned)
    log(f"producer: {share / 1e6:.0f}M elements owned; its share's digest at set-up {producer.digest_load_s:.2f} s")
    rng = np.random.default_rng(0)
    out = {"share_elements": share, "share_digest_load_s": producer.digest_load_s, "rates": {}}
    version = 0
    for rate in rates:
        rows = {"on": [], "off": []}
        for rnd in range(args.rounds):
            changed = perturb(params, rate, rng)
            want = digest.StateDigest()  # the share's digest of the perturbed weights, read whole
            for r in producer.owned:
                want.add(r.param.name, digest.tensor_sums(r.param.name, r.tensor, start=r.start))
            for mode in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
                producer.track_state_digest = mode == "on"
                end.payloads.clear()
                t = time.perf_counter()
                rep = producer.refit(TransferInfo(f"t{version}-{mode}", version, version + 1, ("p0",)))
                rows[mode].append(time.perf_counter() - t)
                if mode == "on" and rep.state_digest != want.hex():
                    sys.exit("digest_cost: the producer's kept digest is not its share's")
                producer.settle(False)
                baseline.abort()
            # commit the round's changes (untimed): the next round diffs from them
            producer.track_state_digest = True
            producer.refit(TransferInfo(f"t{version}-commit", version, version + 1, ("p0",)))
            baseline.commit()
            producer.settle(True)
            version += 1
        out["rates"][str(rate)] = _summary(rows, changed)
        log(f"producer {rate:.0%}: on {_ms(rows['on'])} off {_ms(rows['off'])} "
            f"(x{out['rates'][str(rate)]['ratio']:.3f})")
    return out


def receiver_side(args, rates: list[float]) -> dict:
    runtime = make_runtime(args.hidden, args.layers, args.vocab, None)
    t = time.perf_counter()
    runtime.state_digest()
    load_s = time.perf_counter() - t
    numel = sum(p.numel() for p in runtime.model.parameters())
    log(f"receiver: {numel / 1e9:.3f}B params; whole-model digest {load_s:.2f} s "
        f"({load_s / numel * 1e9:.2f} ns an element)")
    out = {"params": numel, "load_digest_s": load_s, "rates": {}}
    for k, rate in enumerate(rates):
        staged = payloads(runtime, rate, seed=k)
        undo = inverse_payloads(staged)
        changes = sum(len(r) for records in staged for r in records)
        rows = {"on": [], "off": []}
        forward = True
        for rnd in range(args.rounds + 1):  # the first round of each mode: plans, first touches
            for mode in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
                runtime.track_digest = mode == "on"
                before = runtime.state_digest() if mode == "on" and rnd == 1 else None  # checked once, untimed
                t = time.perf_counter()
                with runtime.batch():
                    logs = [runtime.apply(records) for records in (staged if forward else undo)]
                seconds = time.perf_counter() - t
                forward = not forward
                if before is not None:
                    for lg in logs:
                        before.merge(lg.digest)
                    if before != runtime.state_digest():
                        sys.exit("digest_cost: the receiver's kept digest is not its state's")
                if rnd:
                    rows[mode].append(seconds)
        out["rates"][str(rate)] = _summary(rows, changes)
        log(f"receiver {rate:.0%}: pause on {_ms(rows['on'])} off {_ms(rows['off'])} "
            f"(x{out['rates'][str(rate)]['ratio']:.3f})")
    return out


def _summary(rows: dict, changes: int) -> dict:
    on, off = statistics.median(rows["on"]), statistics.median(rows["off"])
    return {"changes": changes, "on_s": rows["on"], "off_s": rows["off"], "median_on_s": on,
            "median_off_s": off, "ratio": on / off, "added_ns_per_change": (on - off) / max(changes, 1) * 1e9}


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ms [{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rates", default="0.01,0.03,0.05")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per rate and side (each runs both modes)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, seconds")
    ap.add_argument("--out", help="results JSON (default benchmarks/results/digest_cost.json; with --smoke, "
                                  "the temp dir)")
    args = ap.parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError as e:
        ap.error(f"--rates takes numbers, comma-separated: {e}")
    if not all(0 < r < 1 for r in rates) or args.rounds < 1:
        ap.error("--rates must lie in (0, 1) and --rounds be at least 1")
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.rounds = 128, 2, 512, 2
    result = {"benchmark": "digest_cost", "machine": machine_info(), "args": vars(args),
              "producer": producer_side(args, rates), "receiver": receiver_side(args, rates)}
    path = results_path("digest_cost", args.out, args.smoke)
    path.write_text(json.dumps(result, indent=1))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
