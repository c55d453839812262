"""Trainer-side speed on ONE CPU core: diff + place + encode of BF16 weights through the
real producer (`nemo_dcr.sender.Producer`), beside memcpy of the same bytes.

    python benchmarks/trainer_speed.py           # ~15 seconds on a quiet machine; results/trainer_speed.{json,png}
    python benchmarks/trainer_speed.py --smoke   # seconds (CI smoke; writes to the temp dir)
    python benchmarks/trainer_speed.py --device cuda   # the weights on a GPU (results/trainer_speed_cuda.*)
    python benchmarks/trainer_speed.py --layout model  # ~40 s; a whole model's tensors (results/trainer_speed_model.*)
    python benchmarks/trainer_speed.py --layout moe    # ~2 min; an MoE model's tensors (results/trainer_speed_moe.*)
    python benchmarks/trainer_speed.py --encode-threads 2  # payloads encoded on 2 more threads (..._threads2.*)
    python benchmarks/trainer_speed.py --device cuda --wire-version 6  # placed and coded on the GPU (..._cuda_v6.*)

Set-up: 4 row-parallel BF16 weights of 4096 x 4096 (64M elements, 128 MiB; --smoke:
4 x 512 x 512), each placed by a strided piece into a 4096 x 8192 canonical tensor (TP
rank 0 of 2), as Megatron lays out a row-parallel linear. At each change rate, random
elements move by +-1 ULP; the producer diffs them against its committed baseline, places
the changes, encodes payloads (the current wire format) and hands them to a transport end that only
counts and keeps them. After every refit, outside the timing, a receiver holding the committed
state (`TensorStoreRuntime`) decodes and applies them, every bit of it is compared with the
trainer's weights, and the apply is undone: `verify_s` is that check's time. Throughput is
bytes of the BF16 weights scanned per second of producer time (diff + place + encode), best
of --repeats; memcpy is np.copyto, best of 3 before each refit (the best of all of them
is reported), measured in the same process, of the same bytes and of a buffer 4x as large
(page-aligned buffers: benchmarks/memcpy.py): the faster of the two is the reference.
(glibc copies with plain stores below a threshold it derives from the cache size, with
non-temporal ones above it: on a host reporting a 480 MiB L3 the 128 MiB copy read
6.9-7.0 GB/s and a 256 MiB one 11.9-12.3, so the same bytes alone could be the slower
copy.) The same ratio on CPU time (time.thread_time, for the refit and for memcpy) is
reported beside: it is less sensitive to other jobs on a shared machine.

With --layout model the producer owns the first half of every parameter of a 4-layer
Qwen3-style model (hidden 2048, vocabulary 32000: 320M parameters, so 160M owned elements,
320 MB; --smoke: hidden 256, 1 layer), 51 tensors of every size from 128 to 65M elements,
placed as is. A real refit codes one record per tensor it touches, so this measures what
each record costs beside each change (the default layout codes 4 large records).

With --layout moe the model is a Qwen3-MoE-style one (benchmarks/qwen3_shapes.py: hidden
2048, 2 layers of 32 experts with intermediate size 768, vocabulary 32000: 458M parameters,
229M owned elements, 458 MB; --smoke: hidden 256, 1 layer of 4 experts), the same half of
every tensor owned: 213 tensors, 192 of them experts of 1.57M elements, as a mixture-of-experts
model's refit codes a record per expert and projection (~24,000 changes each at 3%).

With --encode-threads N the producer encodes full payloads on N more threads while it diffs
on (`Producer(encode_threads=N)`); the rate is then bytes over the refit's wall time, the
CPU-time ratio is the whole process's, and the process keeps freed memory
(`nemo_dcr.malloc.keep_freed_memory`), as a threaded producer should.

With --device cuda the weights live on the GPU: the producer diffs them there against its
device mirror of the baseline (one `ne` + `nonzero` per chunk) and copies only the
changes to the host, where placement and encoding run on one core; memcpy is then a
device-to-device copy of the same bytes (the GPU's memory bandwidth), so the ratio says
how far the host-side work is from the device's speed. With --wire-version 6 as well, the
changes stay on the GPU: placed, gathered into records and coded there (format v6's prefix
streams, `Producer(device_coding="gpu")`); only the baseline's positions and new bits and
the payloads' bytes reach the host. --device-coding always runs that torch path on CPU
weights (slow: a check that it runs, not a measurement of it).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nemo_dcr import kernels  # noqa: E402
from nemo_dcr.wire import codec  # noqa: E402
from benchmarks.outputs import results_path  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.memcpy import memcpy_gbs, touched_pair  # noqa: E402
from benchmarks.qwen3_shapes import qwen3_moe_shapes, qwen3_shapes  # noqa: E402
from nemo_dcr.baseline import Baseline  # noqa: E402
from nemo_dcr.capture import even_split  # noqa: E402
from nemo_dcr.layout import LocalParam, OwnedRange  # noqa: E402
from nemo_dcr.malloc import keep_freed_memory  # noqa: E402
from nemo_dcr.placement import AffineMap, Piece  # noqa: E402
from nemo_dcr.records import Op, TransferInfo  # noqa: E402
from nemo_dcr.runtimes.store import TensorStoreRuntime  # noqa: E402
from nemo_dcr.sender import AUTO, Producer  # noqa: E402
from nemo_dcr.verify import bit_mismatches  # noqa: E402


class KeepingEnd:
    """A ProducerEnd that counts the bytes and keeps a reference to each payload, for the
    check after the refit (no transport cost in the measurement)."""

    def __init__(self):
        self.bytes = 0
        self.payloads = []

    def send(self, transfer, payload_id, data):
        self.bytes += len(data)
        self.payloads.append(data)

    def flush(self, transfer, payload_ids):
        return {}

    def close(self):
        pass


def setup(n_params: int, rows: int, cols: int, device: str = "cpu"):
    """Row-parallel weights (TP rank 0 of 2). Returns (the tensors to perturb, the owned
    ranges, maps, specs, canonical): canonical() is a host copy of the trainer's state in
    checkpoint coordinates (the other rank's half: zeros, never changed)."""
    torch.manual_seed(0)
    params, owned, maps, specs, canon_names = [], [], {}, {}, []
    for i in range(n_params):
        name = f"decoder.layers.{i}.mlp.linear_fc2.weight"
        canon = f"model.layers.{i}.mlp.down_proj.weight"
        t = (torch.randn(rows, cols) * 0.02).to(torch.bfloat16).to(device)
        lp = LocalParam(name, (rows, cols), torch.bfloat16)
        owned.append(OwnedRange(lp, 0, rows * cols, t.view(-1)))
        maps[name] = AffineMap(name, rows * cols, (Piece(canon, 0, rows, cols, 0, 2 * cols),))
        specs[canon] = ("BF16", (rows, 2 * cols))
        params.append(t)
        canon_names.append(canon)

    def canonical() -> dict[str, torch.Tensor]:
        return {c: torch.cat([t.cpu(), torch.zeros_like(t, device="cpu")], dim=1) for c, t in zip(canon_names, params)}

    return params, owned, maps, specs, canonical


def setup_model(shapes: dict[str, tuple[int, ...]], device: str = "cpu"):
    """A model of these tensors (benchmarks/qwen3_shapes.py) of which this producer owns the
    first half of every parameter (data-parallel rank 0 of 2, `capture.torch_owned_ranges`),
    placed as is: many records of every size, as a real model's refit has. Returns the
    owned views as the tensors to perturb, and the rest as `setup` does."""
    torch.manual_seed(0)
    owned, maps, specs, full = [], {}, {}, {}
    for name, shape in shapes.items():
        t = (torch.randn(shape) * 0.02).to(torch.bfloat16).to(device)
        rows, cols = shape if len(shape) == 2 else (1, shape[0])
        start, stop = even_split(t.numel(), 0, 2)
        owned.append(OwnedRange(LocalParam(name, shape, torch.bfloat16), start, stop, t.view(-1)[start:stop]))
        maps[name] = AffineMap(name, t.numel(), (Piece(name, 0, rows, cols, 0, cols),))
        specs[name] = ("BF16", shape)
        full[name] = t

    def canonical() -> dict[str, torch.Tensor]:
        return {n: t.detach().to("cpu", copy=True) for n, t in full.items()}

    return [r.tensor for r in owned], owned, maps, specs, canonical


def check(end: KeepingEnd, receiver: TensorStoreRuntime, expected: dict[str, torch.Tensor], changed: int) -> float:
    """Decode the refit's payloads, apply them to the receiver's copy of the committed state,
    compare every bit with the trainer's state, then undo the apply: the seconds it took.
    Exits on any difference (a benchmark of a wrong refit would be meaningless)."""
    t = time.perf_counter()
    records = [r for data in end.payloads for r in codec.decode(data).records]
    log = receiver.apply(records)
    bad = bit_mismatches(expected, receiver.canonical_state())
    receiver.revert(log)
    got = sum(len(r) for r in records)
    if bad or got != changed:
        sys.exit(f"trainer_speed: the refit is not bit-exact: {got} changes decoded of {changed}; "
                 f"tensors that differ: {bad[:5]}")
    return time.perf_counter() - t


def perturb(params, rate: float, rng) -> int:
    changed = 0
    for t in params:
        bits = t.view(-1).view(torch.int16)
        pos = np.flatnonzero(rng.random(bits.numel()) < rate)
        step = np.where(rng.random(pos.size) < 0.5, 1, -1).astype(np.int16)
        pos_t, step_t = torch.from_numpy(pos).to(t.device), torch.from_numpy(step).to(t.device)
        bits[pos_t] = bits[pos_t] + step_t
        changed += pos.size
    return changed


def device_copy_gbs(n: int, device: str, repeats: int) -> float:
    """GB/s of a device-to-device copy of n int16 elements, best of `repeats`."""
    src = torch.ones(n, dtype=torch.int16, device=device)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return src.numel() * 2 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="where the weights live: cpu (default) or cuda")
    ap.add_argument("--layout", choices=("weights", "model", "moe"), default="weights",
                    help="4 large row-parallel weights (default), a whole Qwen3-style model's tensors, or a "
                         "Qwen3-MoE-style model's (a record per expert)")
    ap.add_argument("--encode-threads", type=int, default=0,
                    help="Producer(encode_threads=N): N more threads encode payloads while one diffs; the rate "
                         "is then the refit's wall time (results: trainer_speed[_model|_moe]_threadsN.*)")
    ap.add_argument("--wire-version", type=int, default=codec.FORMAT_VERSION,
                    help="Producer(wire_version=...): 6 codes the changes of GPU weights on the GPU")
    ap.add_argument("--device-coding", choices=("gpu", "always", "never"), default="gpu",
                    help="Producer(device_coding=...), with --wire-version 6")
    ap.add_argument("--out", default=None,
                    help="results JSON (default: benchmarks/results/trainer_speed.json; with --smoke, the temp dir)")
    args = ap.parse_args()
    if args.encode_threads < 0:
        sys.exit(f"trainer_speed: --encode-threads must be >= 0, got {args.encode_threads}")
    threads = args.encode_threads
    if threads:
        # glibc gives each encoding thread a malloc arena of its own, which hands freed memory
        # back to the OS: ~9,000 page faults a refit here. Keep it, as a threaded producer should.
        keep_freed_memory()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit(f"trainer_speed: --device {args.device} needs a CUDA GPU, and torch sees none")
    name = ("trainer_speed" + ("" if args.layout == "weights" else f"_{args.layout}") + ("_cuda" if cuda else "")
            + (f"_threads{threads}" if threads else "")
            + (f"_v{args.wire_version}" if args.wire_version != codec.FORMAT_VERSION else "")
            + (f"_coding_{args.device_coding}" if args.device_coding != "gpu" else ""))
    out = results_path(name, args.out, args.smoke)
    load_before = list(os.getloadavg())
    torch.set_num_threads(1)
    rows = cols = 512 if args.smoke else 4096
    rates = [0.01, 0.05] if args.smoke else [0.001, 0.01, 0.03, 0.05]
    ops = [Op.XOR, AUTO]
    repeats = 2 if args.smoke else args.repeats
    if args.layout == "model":
        shapes = qwen3_shapes(*((256, 1, 1000) if args.smoke else (2048, 4, 32000)))
        params, owned, maps, specs, canonical = setup_model(shapes, args.device)
    elif args.layout == "moe":
        shapes = qwen3_moe_shapes(*((256, 1, 1000, 4, 128) if args.smoke else (2048, 2, 32000, 32, 768)))
        params, owned, maps, specs, canonical = setup_model(shapes, args.device)
    else:
        params, owned, maps, specs, canonical = setup(4, rows, cols, args.device)
    total = sum(t.numel() for t in params)
    # memcpy of the same bytes and of 4x as many (past glibc's switch to non-temporal stores
    # on the hosts measured): the faster is the reference (module docstring).
    copies = [] if cuda else [touched_pair(total), touched_pair(4 * total)]
    rng = np.random.default_rng(0)
    print(f"[trainer_speed] {total:,} BF16 elements ({2 * total / 2**20:.0f} MiB) on {args.device}, "
          f"{'one core' if not threads else f'one diffing thread + {threads} encoding'}, "
          f"repeats={repeats}, compiled kernels {kernels.common.HAVE_NUMBA}, "
          f"AVX-512 diff {kernels.diff.HAVE_VECTOR_DIFF}",
          flush=True)
    rows_out = []
    cpu_clock = time.process_time if threads else time.thread_time  # with encode threads: the whole process's
    for rate in rates:
        for op in ops:
            baseline = Baseline()
            end = KeepingEnd()
            prod = Producer("p0", owned, maps, specs, baseline, end, op=op, encode_threads=threads,
                            wire_version=args.wire_version, device_coding=args.device_coding)
            # A receiver holding the committed state, to check every refit (outside the timing).
            receiver = TensorStoreRuntime(canonical())
            changed = perturb(params, rate, rng)
            expected = canonical()
            best, mem, mem_cpu, cpu_best, verify_s = None, 0.0, 0.0, float("inf"), []
            mem_sizes = [0.0, 0.0]  # the best wall-clock reading of each copy size
            for rep in range(repeats):
                if cuda:  # the reference is the device's own copy bandwidth
                    m_wall = m_cpu = device_copy_gbs(total, args.device, 3)
                else:
                    readings = [memcpy_gbs(s, d, 3) for s, d in copies]
                    mem_sizes = [max(m, r[0]) for m, r in zip(mem_sizes, readings)]
                    m_wall, m_cpu = max(r[0] for r in readings), max(r[1] for r in readings)
                mem, mem_cpu = max(mem, m_wall), max(mem_cpu, m_cpu)
                end.bytes, end.payloads = 0, []
                info = TransferInfo(f"t{rep}", 0, 1, ("p0",))
                c0, w0 = cpu_clock(), time.perf_counter()
                rep_ = prod.refit(info)
                wall = time.perf_counter() - w0
                cpu_best = min(cpu_best, cpu_clock() - c0)
                baseline.abort()
                verify_s.append(check(end, receiver, expected, changed))
                t = rep_.times
                # One thread: the stages' sum. With encode threads they overlap: the refit's wall time.
                busy = wall if threads else t["diff"] + t["place"] + t["encode"]
                if best is None or busy < best["busy_s"]:
                    best = {"busy_s": busy, "diff_s": t["diff"], "place_s": t["place"], "encode_s": t["encode"],
                            "wire_bytes": end.bytes, "changed": rep_.changed_elements,
                            "scanned_bytes": rep_.scanned_bytes, "payloads": rep_.payloads}
            gbs = best["scanned_bytes"] / best["busy_s"] / 1e9
            row = {"rate": rate, "op": AUTO if op == AUTO else Op(op).value, "memcpy_gbs": mem,
                   # the two copies' readings (CPU runs): the same bytes, 4x as many
                   "memcpy_same_bytes_gbs": None if cuda else mem_sizes[0],
                   "memcpy_4x_bytes_gbs": None if cuda else mem_sizes[1],
                   "total_gbs": gbs, "ratio_to_memcpy": gbs / mem,
                   "diff_gbs": best["scanned_bytes"] / best["diff_s"] / 1e9,
                   "place_gbs": best["scanned_bytes"] / max(best["place_s"], 1e-12) / 1e9,
                   "encode_gbs": best["scanned_bytes"] / max(best["encode_s"], 1e-12) / 1e9,
                   "ns_per_change_encode": best["encode_s"] / max(best["changed"], 1) * 1e9,
                   "ns_per_change_total": best["busy_s"] / max(best["changed"], 1) * 1e9,
                   # CPU time (thread_time) of the whole refit and of memcpy: robust to a
                   # machine shared with other jobs, where wall-clock includes preemption.
                   "cpu_refit_s": cpu_best, "memcpy_cpu_gbs": mem_cpu,
                   "cpu_gbs": best["scanned_bytes"] / cpu_best / 1e9,
                   "cpu_ratio_to_memcpy": best["scanned_bytes"] / cpu_best / 1e9 / mem_cpu,
                   "bit_exact": True, "verify_s": float(np.median(verify_s)), **best}
            assert best["changed"] == changed, (best["changed"], changed)
            rows_out.append(row)
            sizes_note = "" if cuda else f"; same bytes {mem_sizes[0]:.2f}, 4x {mem_sizes[1]:.2f}"
            print(f"  rate {rate:>6.1%} op={row['op']:<4}: diff+place+encode {gbs:5.2f} GB/s = "
                  f"{row['ratio_to_memcpy']:.2f} x memcpy ({mem:.2f} GB/s{sizes_note})  "
                  f"[diff {row['diff_gbs']:.2f}, place "
                  f"{row['place_gbs']:.2f}, encode {row['encode_gbs']:.2f} GB/s]  wire {best['wire_bytes']:,} B; "
                  f"CPU time: {row['cpu_gbs']:.2f} GB/s = {row['cpu_ratio_to_memcpy']:.2f} x memcpy "
                  f"({mem_cpu:.2f} GB/s); every refit bit-exact (verify {row['verify_s']:.2f} s each)",
                  flush=True)
            # Commit nothing: restore the committed bits for the next rate.
            for r in owned:
                r.tensor.view(torch.int16).copy_(baseline.committed(r.key))
    result = {"benchmark": "trainer_speed", "smoke": args.smoke, "device": args.device, "layout": args.layout,
              "tensors": len(owned),
              "gpu": torch.cuda.get_device_name() if cuda else None, "elements": total, "threads": 1 + threads,
              "wire_version": args.wire_version, "device_coding": args.device_coding,
              "machine": machine_info(load_average_before=load_before, load_average=list(os.getloadavg())),
              "compiled_kernels": kernels.common.HAVE_NUMBA, "vector_diff": kernels.diff.HAVE_VECTOR_DIFF,
              "rows": rows_out}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for op in sorted({r["op"] for r in rows_out}):
            rs = [r for r in rows_out if r["op"] == op]
            ax.plot([r["rate"] for r in rs], [r["total_gbs"] for r in rs], marker="o",
                    label=f"diff+place+encode ({op})")
        rates_ = sorted({r["rate"] for r in rows_out})
        ax.plot(rates_, [0.3 * float(np.mean([r["memcpy_gbs"] for r in rows_out if r["rate"] == x])) for x in rates_],
                "k--", label="0.30 x memcpy (same run)")
        ax.set_xscale("log")
        ax.set_xlabel("change rate")
        ax.set_ylabel(f"GB/s of BF16 weights, {f'{1 + threads} threads' if threads else 'one core'}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
    except ImportError:
        print("(matplotlib missing: no plot)")
    print("\n| change rate | op | memcpy GB/s | diff+place+encode GB/s | x memcpy | diff | place | encode | "
          "encode ns/change | total ns/change | CPU-time x memcpy | wire bytes | verify s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['rate']:.1%} | {r['op']} | {r['memcpy_gbs']:.2f} | {r['total_gbs']:.2f} | "
              f"{r['ratio_to_memcpy']:.2f} | "
              f"{r['diff_gbs']:.2f} | {r['place_gbs']:.2f} | {r['encode_gbs']:.2f} | {r['ns_per_change_encode']:.0f} | "
              f"{r['ns_per_change_total']:.0f} | {r['cpu_ratio_to_memcpy']:.2f} | {r['wire_bytes']:,} | "
              f"{r['verify_s']:.2f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
