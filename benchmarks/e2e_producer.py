"""torchrun worker of benchmarks/e2e_link.py: one of the producer processes.

Every rank loads the same BF16 checkpoint (a replica, as DP ranks hold one), owns an even
share of every parameter (`torch_owned_ranges`), and refits the receivers over the relay
tree once per change rate: the same seeded ±1-ULP changes are applied on every rank (so
the replicas stay equal), then `TrainerRefit.refit()` is timed. After each refit rank 0
compares every receiver's digests with its own state (timed separately) and appends one
JSON line to --results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def perturb(model: torch.nn.Module, rate: float, seed: int) -> int:
    """Move `rate` of every parameter's elements by ±1 ULP (same on every rank)."""
    rng = np.random.default_rng(seed)
    changed = 0
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            bits = p.data.view(torch.int16).view(-1)
            n = bits.numel()
            k = int(rng.binomial(n, rate))
            pos = torch.from_numpy(rng.choice(n, size=k, replace=False) if k < n // 8
                                   else np.flatnonzero(rng.random(n, dtype=np.float32) < rate))
            step = torch.from_numpy(rng.choice(np.array([1, -1], np.int16), size=pos.numel()))
            bits[pos] += step
            changed += pos.numel()
    return changed


def ulps(bits: torch.Tensor) -> torch.Tensor:
    """The ULP of each BF16 element (from its exponent field; subnormals take the smallest)."""
    exp = ((bits.to(torch.int32) >> 7) & 0xFF).clamp(min=1)
    return torch.pow(2.0, (exp - 127 - 7).to(torch.float32))


def adamw_lr(model: torch.nn.Module, rate: float, sample: int = 1 << 20, seed: int = 0) -> float:
    """The step size at which `perturb_adamw` changes `rate` of the elements: the mean over a
    sample of min(1, lr / ULP) is `rate` (bisection in log space)."""
    g = torch.Generator().manual_seed(seed)
    params = [p.data.view(torch.int16).view(-1) for _, p in sorted(model.named_parameters())]
    total = sum(p.numel() for p in params)
    u = torch.cat([ulps(p[torch.randint(0, p.numel(), (max(1, sample * p.numel() // total),), generator=g)])
                   for p in params])
    lo, hi = 1e-12, 1.0
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if float(torch.clamp(mid / u, max=1.0).mean()) < rate else (lo, mid)
    return (lo * hi) ** 0.5


def perturb_adamw(model: torch.nn.Module, lr: float, seed: int) -> int:
    """One AdamW-like step seen through BF16 (same on every rank): Adam's early steps move
    each FP32 master weight by about lr, up or down, and the master sits anywhere within
    its BF16 value's rounding interval; so an element crosses floor(lr / ULP + U(0, 1))
    rounding boundaries, in the step's direction. Small weights (small ULP) change more
    often and by more ULPs than large ones, as on real pretrained weights."""
    g = torch.Generator().manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            bits = p.data.view(torch.int16).view(-1)
            moves = torch.floor(lr / ulps(bits) + torch.rand(bits.shape, generator=g)).to(torch.int32)
            sign = torch.randint(0, 2, bits.shape, generator=g, dtype=torch.int32) * 2 - 1
            mag = (bits.to(torch.int32) & 0x7FFF)
            moves = torch.where(sign < 0, torch.minimum(moves, mag), moves)  # no step through zero
            new_mag = (mag + sign * moves).clamp(max=0x7F7F)  # and none past the largest finite value
            idx = torch.nonzero(new_mag != mag).view(-1)
            bits[idx] = ((bits[idx].to(torch.int32) & 0x8000) | new_mag[idx]).to(torch.int16)
            changed += idx.numel()
    return changed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--transport-config", required=True)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--rates", required=True, help="comma-separated change rates, one refit each")
    ap.add_argument("--results", required=True)
    ap.add_argument("--op", default="auto", choices=["auto", "xor", "add"])
    ap.add_argument("--no-state-digest", action="store_true", help="keep no whole-state digest")
    ap.add_argument("--changes", default="ulp", choices=["ulp", "adamw"],
                    help="±1 ULP at random elements (perturb), or AdamW-like steps (perturb_adamw)")
    ap.add_argument("--conditioned", action="store_true", help="TrainerRefit(conditioned=True)")
    ap.add_argument("--payload-elements", required=True,
                    help="max_payload_elements; several (comma-separated) take turns within each rate")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from nemo_dcr import registry
    from nemo_dcr.capture import torch_owned_ranges
    from nemo_dcr.checkpoint import read_specs
    from nemo_dcr.layout import ParallelLayout
    from nemo_dcr.trainer import TrainerRefit
    from nemo_dcr.verify import state_digests

    sizes = [int(x) for x in args.payload_elements.split(",")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16)
    config = json.loads(args.transport_config)
    transport = registry.transport("relay", config, receivers=[n["id"] for n in config["nodes"]])
    refit = TrainerRefit(registry.converter("identity", model.config), read_specs(args.checkpoint),
                         torch_owned_ranges(model, rank, world), ParallelLayout(dp_size=world, dp_rank=rank),
                         transport, state_dir=args.state_dir, op=args.op, max_payload_elements=sizes[0],
                         timeout_s=600, state_digest=not args.no_state_digest, conditioned=args.conditioned)
    if rank == 0:
        print(f"[producer] {world} producers ready in {time.perf_counter() - t:.1f} s", flush=True)
    # A first, small refit warms up what happens once per process (compiling the kernels,
    # planning each tensor's loader geometry on the receivers); it is not reported.
    rates = [0.001] + [float(r) for r in args.rates.split(",")]
    # Several payload sizes take turns within a rate, the k-th rate starting k sizes on: its
    # first refit, the slowest (first touches of memory), falls to a different size.
    firsts = {rate: k for k, rate in enumerate(dict.fromkeys(rates[1:]))}
    schedule = [sizes[0]] + [sizes[(firsts[r] + rates[1:i + 1].count(r)) % len(sizes)]
                             for i, r in enumerate(rates[1:])]
    for i, (rate, size) in enumerate(zip(rates, schedule)):
        refit.producer.max_payload_elements = size
        if args.changes == "adamw":
            changed = perturb_adamw(model, adamw_lr(model, rate), seed=1000 + i)
        else:
            changed = perturb(model, rate, seed=1000 + i)
        dist.barrier()
        result = refit.refit()
        t = time.perf_counter()
        state = {k: v for k, v in model.state_dict().items()}
        mismatches = refit.verify(state_digests(state) if rank == 0 else None)
        verify_s = time.perf_counter() - t
        if rank == 0:
            m = result.metrics()
            exact = all(not bad for bad in mismatches.values())
            row = {"rate": rate, "warmup": i == 0, "payload_elements": size, "changed_elements": changed,
                   "bit_exact": exact, "verify_s": verify_s,
                   "mismatches": {rx: bad[:3] for rx, bad in mismatches.items()}, **m}
            with open(args.results, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"[producer] {rate:.1%}: refit {m['refit_s']:.2f} s, wire {m['wire_bytes'] / 1e6:.1f} MB, "
                  f"pause {m['pause_s']:.2f} s, verify {verify_s:.1f} s, bit-exact: {exact}", flush=True)
        dist.barrier()
    refit.close(shutdown_receivers=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
