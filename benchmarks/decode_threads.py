"""Receiver-side decode on several threads: one payload of many BF16 records (AdamW-like
changes of normally distributed weights: small weights cross more rounding boundaries),
plain and baseline-conditioned, decoded on 1..N threads (`codec.decode(threads=)`, what
`Receiver(decode_threads=)` uses). Reports universe elements per second, the speed-up
over one thread, and checks every decode gives the same records.

    python benchmarks/decode_threads.py            # about a minute; results/decode_threads.json
    python benchmarks/decode_threads.py --smoke    # seconds (JSON in the temp dir)

One thread per core at most is what it measures: the projection (`nemo-dcr project`)
takes decode throughput per receiver core times the threads each receiver decodes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.outputs import results_path  # noqa: E402
from nemo_dcr.records import BaseSpan, Op, Payload, PayloadHeader, Record  # noqa: E402
from nemo_dcr.wire import codec  # noqa: E402
from nemo_dcr.wire.conditioned import BitsByName  # noqa: E402


def lr_for(old: torch.Tensor, rate: float) -> float:
    """The step size whose expected share of changed elements is `rate`: a step of lr
    crosses a rounding boundary of a weight whose ULP is u with probability min(1, lr/u)."""
    ulp = torch.exp2(((old.view(torch.int16).to(torch.int32) >> 7) & 0xFF).to(torch.float32) - 127 - 7)
    lo, hi = 0.0, float(ulp.max())
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(torch.clamp(mid / ulp, max=1).mean()) < rate else (lo, mid)
    return (lo + hi) / 2


def payload(tensors: int, n: int, rate: float, conditioned: bool, seed: int = 0) -> tuple[bytes, dict]:
    """(encoded payload, old bits by name): `tensors` records of n elements, about `rate`
    of them changed by an add of one AdamW-like step (the same size for every weight)."""
    g = torch.Generator().manual_seed(seed)
    records, olds = [], {}
    for i in range(tensors):
        w = torch.randn(n, generator=g) * 0.02
        old = w.to(torch.bfloat16)
        new = (w + lr_for(old, rate) * torch.sign(torch.randn(n, generator=g))).to(torch.bfloat16)
        ob, nb = old.view(torch.int16).numpy().view(np.uint16), new.view(torch.int16).numpy().view(np.uint16)
        pos = np.flatnonzero(ob != nb).astype(np.uint64)
        vals = (nb[pos.astype(np.int64)] - ob[pos.astype(np.int64)]).astype(np.uint16)
        base = BaseSpan(0, ob) if conditioned else None
        records.append(Record(f"layer{i}.weight", "BF16", (n,), Op.ADD, pos, vals, base=base))
        olds[records[-1].name] = ob
    return codec.encode(Payload(PayloadHeader("t", 0, 1, "p0", "p0-000000"), records)), olds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--elements", type=int, default=1 << 22, help="per tensor")
    ap.add_argument("--rates", default="0.01,0.03")
    ap.add_argument("--threads", default=None, help="comma list (default 1..cores)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tensors, args.elements, args.repeats = 4, 1 << 16, 1
    cores = os.cpu_count() or 1
    threads = [int(t) for t in args.threads.split(",")] if args.threads else list(range(1, cores + 1))
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        for cond in (False, True):
            data, olds = payload(args.tensors, args.elements, rate, cond)
            if cond and b"gaps_conditioned" not in codec.header_text(data).encode():
                raise SystemExit("the encoder kept the plain coding: no conditioned record to measure")
            universe = args.tensors * args.elements
            reference = codec.decode(data, baselines=BitsByName(olds)).records
            times = {t: [] for t in threads}
            for _ in range(args.repeats):
                for t in threads:  # alternated, so that drift on a shared host hits every count alike
                    t0 = time.perf_counter()
                    got = codec.decode(data, baselines=BitsByName(olds), threads=t).records
                    times[t].append(time.perf_counter() - t0)
                    if not all(np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values)
                               for a, b in zip(reference, got)):
                        raise AssertionError(f"{t} threads decoded other records")
            one = statistics.median(times[threads[0]])
            for t in threads:
                med = statistics.median(times[t])
                rows.append({"rate": rate, "conditioned": cond, "threads": t, "payload_bytes": len(data),
                             "changes": sum(r.positions.size for r in reference), "universe": universe,
                             "median_s": med, "range_s": [min(times[t]), max(times[t])],
                             "elements_per_s": universe / med, "speedup": one / med})
                print(f"rate {rate:.0%} {'conditioned' if cond else 'plain      '} {t} thread(s): "
                      f"{universe / med / 1e6:7.0f} M elements/s, x{one / med:.2f} "
                      f"(range {min(times[t]) * 1e3:.0f}-{max(times[t]) * 1e3:.0f} ms)", flush=True)
    out = results_path("decode_threads", args.out, args.smoke)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "decode_threads", "smoke": args.smoke, "tensors": args.tensors,
                               "elements_per_tensor": args.elements, "cores": cores, "rows": rows,
                               "machine": machine_info()}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
