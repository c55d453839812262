"""What reliability costs: read-back verification, storing the history, anchors, catch-up,
and an in-place retry, beside a plain refit of the same model and change rate.

    python benchmarks/reliability_costs.py            # ~3-5 minutes; results/reliability_costs.{json,png}
    python benchmarks/reliability_costs.py --smoke    # seconds (CI smoke; writes to the temp dir)

Set-up: a Llama-shaped Hugging Face model in BF16 (default ~110M parameters; --smoke:
~1M), one trainer rank and one real HF receiver (thread) over the local transport. Each
refit flips random elements by +-1 ULP at --rate (default 3%) in the trainer's weights,
then refits; every refit is verified bit-exact (time reported separately). Rows:

- plain: a refit with nothing extra (median of --repeats);
- readback: the same with `readback=True` (receivers digest every applied region, producers
  digest the new bits; the commit waits for the match);
- history: the same with a history directory (each committed delta stored after the commit);
- anchor: writing one anchor (the whole model as overwrites) to the history;
- retry: a refit whose first attempt is interrupted half-way on the receiver (retried in
  place as overwrites);
- catch-up: a fresh receiver (the initial checkpoint loaded) replaying the deltas since v0,
  and one with unknown bits replaying the newest anchor + the deltas after it, beside a
  dense `from_pretrained` load of a checkpoint of the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.outputs import results_path  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from nemo_dcr import dtypes, registry  # noqa: E402
from nemo_dcr.capture import torch_owned_ranges  # noqa: E402
from nemo_dcr.checkpoint import read_specs  # noqa: E402
from nemo_dcr.cli import make_checkpoint  # noqa: E402
from nemo_dcr.layout import ParallelLayout  # noqa: E402
from nemo_dcr.receiver import Receiver  # noqa: E402
from nemo_dcr.runtimes.hf import HFRuntime  # noqa: E402
from nemo_dcr.trainer import TrainerRefit  # noqa: E402
from nemo_dcr.verify import bit_mismatches  # noqa: E402
from tests.support.faults import FaultyRuntime  # noqa: E402


class Bench:
    def __init__(self, ckpt: Path, work: Path, **refit_kw):
        from transformers import AutoModelForCausalLM

        self.ckpt, self.work = ckpt, work
        self.transport = registry.transport("local", {"dir": str(work / "shm"), "timeout_s": 120}, receivers=["rx0"])
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
        self.runtime = FaultyRuntime(HFRuntime(model, checkpoint_dir=ckpt))
        self.receiver = Receiver("rx0", self.runtime, self.transport.receiver("rx0"))
        self.thread = threading.Thread(target=self.receiver.serve_forever, args=(0.01,), daemon=True)
        self.thread.start()
        self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
        self.refit = TrainerRefit(registry.converter("identity", self.model.config), read_specs(ckpt),
                                  torch_owned_ranges(self.model), ParallelLayout(), self.transport,
                                  state_dir=str(work / "state"), timeout_s=120, **refit_kw)
        self.gen = torch.Generator().manual_seed(1)

    def change(self, rate: float) -> None:
        """+-1 ULP at `rate` of the elements of every parameter (in place, on the bits)."""
        with torch.no_grad():
            for p in self.model.parameters():
                bits = dtypes.bits_of(p.data).view(-1)
                hit = torch.rand(bits.numel(), generator=self.gen) < rate
                step = torch.where(torch.rand(bits.numel(), generator=self.gen) < 0.5, 1, -1).to(bits.dtype)
                bits[hit] += step[hit]

    def expected(self) -> dict:
        return {k: v for k, v in self.model.state_dict().items() if k != "lm_head.weight"}

    def timed_refit(self, rate: float) -> dict:
        self.change(rate)
        result = self.refit.refit()
        v = result.decision.version
        while self.receiver.serving_version != v:
            time.sleep(0.001)
        t = time.perf_counter()
        bad = bit_mismatches(self.expected(), self.runtime.canonical_state())
        verify_s = time.perf_counter() - t
        if bad:
            raise SystemExit(f"refit {v} is not bit-exact: {bad[:3]}")
        m = result.metrics()
        return {"refit_s": result.seconds, "attempts": result.attempts, "verify_s": verify_s,
                "pause_s": m["pause_s"], "readback_s": m["receiver_readback_s"], "digest_s": m["producer_digest_s"],
                "history_s": m.get("coordinator_history_s", 0.0), "wire_bytes": m["wire_bytes"],
                "changed": m["changed_elements"]}

    def close(self) -> None:
        self.refit.close(shutdown_receivers=True)
        self.thread.join(30)
        self.receiver.end.close()
        self.transport.cleanup()


def median_row(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rate", type=float, default=0.03)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="results JSON (default benchmarks/results/reliability_costs.json; "
                                  "with --smoke, the temp dir)")
    args = ap.parse_args(argv)
    repeats = 1 if args.smoke else args.repeats
    out: dict = {"benchmark": "reliability_costs", "smoke": args.smoke, "rate": args.rate,
                 "machine": machine_info(load_average=os.getloadavg())}
    with tempfile.TemporaryDirectory(prefix="dcr-relcost-") as tmp:
        tmp = Path(tmp)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            size = (dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512) if args.smoke else
                    dict(hidden=1024, layers=8, heads=16, kv_heads=4, ffn=2816, vocab=32000))
            ckpt = make_checkpoint(tmp / "ckpt", family="llama", tied=True, **size)
            out["params"] = sum(int(torch.tensor(s).prod()) if s else 1 for _, s in read_specs(ckpt).values())
            rows = {}
            for name, kw in (("plain", {}), ("readback", {"readback": True}),
                             ("history", {"history": str(tmp / "history")})):
                b = Bench(ckpt, tmp / name, **kw)
                try:
                    b.timed_refit(args.rate)  # warm-up (compilation, first-touch)
                    rows[name] = median_row([b.timed_refit(args.rate) for _ in range(repeats)])
                    print(f"{name:9s} refit {rows[name]['refit_s']:.3f} s", flush=True)
                    if name == "history":
                        hist = b.refit.history
                        t = time.perf_counter()
                        b.refit._store_anchor(b.refit.baseline.version)
                        out["anchor_s"] = time.perf_counter() - t
                        out["anchor_bytes"] = sum(f.stat().st_size for f in (tmp / "history" / "anchors").rglob("*"))
                        b.runtime.arm("half", after_calls=1)
                        rows["retry"] = b.timed_refit(args.rate)
                        print(f"retry     refit {rows['retry']['refit_s']:.3f} s "
                              f"({rows['retry']['attempts']} attempts)", flush=True)
                        expected = b.expected()
                        out["catch_up"] = {}
                        for how in ("deltas", "anchor"):  # known bits (v0): deltas; unknown bits: anchor
                            late = _fresh_receiver(ckpt, hist)
                            if how == "anchor":
                                late.uncertain_state = "benchmark: bits unknown"
                            t = time.perf_counter()
                            rep = late.catch_up()
                            out["catch_up"][how] = {"seconds": time.perf_counter() - t, "anchor": rep.anchor,
                                                    "deltas": rep.deltas, "bytes": rep.bytes,
                                                    "payloads": rep.payloads}
                            if bit_mismatches(expected, late.runtime.canonical_state()):
                                raise SystemExit(f"catch-up ({how}) is not bit-exact")
                            print(f"catch-up by {how}: {out['catch_up'][how]['seconds']:.3f} s "
                                  f"(anchor {rep.anchor}, deltas {rep.deltas})", flush=True)
                        t = time.perf_counter()
                        _fresh_receiver(ckpt, hist)
                        out["dense_load_s"] = time.perf_counter() - t
                        print(f"dense load {out['dense_load_s']:.3f} s", flush=True)
                finally:
                    b.close()
            out["rows"] = rows
            plain = rows["plain"]["refit_s"]
            out["overhead"] = {k: rows[k]["refit_s"] / plain - 1 for k in ("readback", "history")}
        finally:
            dist.destroy_process_group()
    path = results_path("reliability_costs", args.out, args.smoke)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    plot(out, path.with_suffix(".png"))
    print(json.dumps({k: out[k] for k in ("params", "overhead", "anchor_s", "catch_up", "dense_load_s")}, indent=1))
    return 0


def plot(result: dict, path: Path) -> None:
    """One bar per cost, in seconds, the plain refit's time marked for scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, catch = result["rows"], result["catch_up"]
    bars = [("plain refit", rows["plain"]["refit_s"]),
            ("refit + read-back", rows["readback"]["refit_s"]),
            ("refit + history", rows["history"]["refit_s"]),
            (f"retried refit ({rows['retry']['attempts']} attempts)", rows["retry"]["refit_s"]),
            ("writing an anchor", result["anchor_s"]),
            (f"catch-up by {len(catch['deltas']['deltas'])} deltas", catch["deltas"]["seconds"]),
            ("catch-up: anchor + deltas", catch["anchor"]["seconds"]),
            ("dense load (from_pretrained)", result["dense_load_s"])]
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.barh([b[0] for b in bars][::-1], [b[1] for b in bars][::-1], color="#4a7")
    ax.axvline(rows["plain"]["refit_s"], color="k", ls="--", lw=1)
    ax.set_xlabel("seconds")
    ax.set_title(f"{result['params'] / 1e6:.0f}M params, {result['rate']:.0%} of elements changed "
                 "(dashed: plain refit)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fresh_receiver(ckpt: Path, history) -> Receiver:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    return Receiver("late", HFRuntime(model, checkpoint_dir=ckpt), None, history=history)


if __name__ == "__main__":
    sys.exit(main())
