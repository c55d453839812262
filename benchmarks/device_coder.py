"""Diff + code on the device that holds the weights: format v6's device coder
(`nemo_dcr.prefix`) on whole-tensor records, beside the device's own copy bandwidth.

    python benchmarks/device_coder.py --device cuda   # ~1 min on a GPU machine; results/device_coder_cuda.{json,png}
    python benchmarks/device_coder.py --smoke         # seconds, on CPU tensors (CI smoke; the temp dir)

Set-up: 4 BF16 weights of 4096 x 4096 (64M elements, 128 MiB; --smoke: 4 x 512 x 512) on
--device, and a copy of them as the committed baseline on the same device. At each change
rate, random elements move by +-1 ULP; then, timed (synchronised before and after): per
weight, the changed positions (`ne` + `nonzero`) and their xor values, and one v6 payload
of the four records coded where they are (`codec.encode(..., version=6)`: histograms,
code tables and the bit stream on the device; the finished bytes, histograms and escapes
copied to the host). Throughput is bytes of the BF16 weights scanned per second of that,
best of --repeats; memcpy is a device-to-device copy of the same bytes, best of 5. After
each refit, outside the timing, the payload is decoded on the host and checked against
the changes made (`verify_s`), and the same records coded on the host as v5 give the
bytes beside it. This is the coding a GPU producer would run; the producer itself
(`nemo_dcr.sender.Producer`) does not hand its changes to it yet (its placement and
payload building are host-side), so placement is not in it: the records are whole
tensors. On CPU tensors the same code runs as torch CPU ops (slow; it is the check that
it runs, not a measurement of it).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.outputs import results_path  # noqa: E402
from nemo_dcr import codec  # noqa: E402
from nemo_dcr.records import Op, Payload, PayloadHeader, Record  # noqa: E402

HDR = PayloadHeader("bench", 0, 1, "p0", "p0-0")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def device_copy_gbs(n: int, device: str, repeats: int = 5) -> float:
    """GB/s of a copy of n int16 elements on the device, best of `repeats`."""
    src = torch.ones(n, dtype=torch.int16, device=device)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return src.numel() * 2 / best / 1e9


def perturb(weights: list[torch.Tensor], rate: float, gen: torch.Generator) -> None:
    """Move a `rate` share of each weight's elements by +-1 ULP (on the bits), on the device."""
    for w in weights:
        bits = w.view(-1)
        hit = torch.rand(bits.numel(), generator=gen, device=bits.device) < rate
        step = torch.where(torch.rand(bits.numel(), generator=gen, device=bits.device) < 0.5, 1, -1)
        bits.add_(torch.where(hit, step, 0).to(torch.int16))


def diff_and_code(weights, committed, names, shape, device: str) -> tuple[bytes, list[Record], float, float]:
    """(the v6 payload, its records as tensors, seconds diffing, seconds coding)."""
    sync(device)
    t = time.perf_counter()
    records = []
    for name, w, c in zip(names, weights, committed):
        pos = torch.ne(w, c).view(-1).nonzero().view(-1)
        records.append(Record(name, "BF16", shape, Op.XOR, pos, (w.view(-1)[pos] ^ c.view(-1)[pos])))
    sync(device)
    t_diff = time.perf_counter() - t
    t = time.perf_counter()
    data = codec.encode(Payload(HDR, records), version=6)
    sync(device)
    return data, records, t_diff, time.perf_counter() - t


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["diff_s"] * 1e3 for r in rows], 0.4, label="diff (ne + nonzero, xor values)")
    ax.bar(x + 0.2, [r["code_s"] * 1e3 for r in rows], 0.4, label="code (format v6, on the device)")
    ax.set_xticks(x, [f"{r['rate']:.1%}\n{r['x_memcpy']:.3f} x copy" for r in rows])
    ax.set_ylabel("ms (best refit)")
    ax.set_title(f"Diff + code of {result['elements'] * 2 / 2**20:.0f} MiB BF16 on {result['device']}"
                 f" (copy {result['memcpy_gbs']:.0f} GB/s)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="where the weights live: cuda, or cpu (a check that it runs)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (for CI)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="results JSON (default benchmarks/results/device_coder_<device>.json)")
    args = ap.parse_args()
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"device_coder: --device {device} needs a CUDA GPU, and torch sees none")
    side = 512 if args.smoke else 4096
    shape = (side, side)
    names = [f"layers.{i}.weight" for i in range(4)]
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [(torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).view(torch.int16)
               for _ in names]
    total = sum(w.numel() for w in weights)
    memcpy = device_copy_gbs(total, device)
    print(f"[device_coder] {device}: 4 x {side} x {side} BF16 ({total * 2 / 2**20:.0f} MiB); "
          f"copy on the device {memcpy:.1f} GB/s", flush=True)
    rows = []
    for rate in ([0.01, 0.05] if args.smoke else [0.001, 0.01, 0.03, 0.05]):
        best = None
        for _ in range(args.repeats):
            committed = [w.clone() for w in weights]
            perturb(weights, rate, gen)
            data, records, t_diff, t_code = diff_and_code(weights, committed, names, shape, device)
            t = time.perf_counter()
            host = [Record(r.name, r.dtype, r.shape, r.op, r.positions.cpu().numpy().astype(np.uint64),
                           r.values.cpu().numpy().view(np.uint16)) for r in records]
            back = codec.decode(data).records
            if any(not (np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values))
                   for a, b in zip(host, back, strict=True)):
                sys.exit(f"device_coder: the v6 payload at {rate:.1%} does not decode to the changes made")
            verify_s = time.perf_counter() - t
            if best is None or t_diff + t_code < best["diff_s"] + best["code_s"]:
                changed = sum(len(r.positions) for r in host)
                best = {"rate": rate, "changed": changed, "diff_s": t_diff, "code_s": t_code,
                        "gbs": total * 2 / (t_diff + t_code) / 1e9, "wire_bytes": len(data),
                        "v5_bytes": len(codec.encode(Payload(HDR, host))), "verify_s": verify_s,
                        "ns_per_change": (t_diff + t_code) / max(changed, 1) * 1e9}
        best["x_memcpy"] = best["gbs"] / memcpy
        rows.append(best)
        print(f"  {rate:>6.1%}: {best['gbs']:8.2f} GB/s = {best['x_memcpy']:.4f} x copy  (diff "
              f"{best['diff_s'] * 1e3:.2f} ms, code {best['code_s'] * 1e3:.2f} ms, {best['changed']:,} changes); "
              f"wire {best['wire_bytes']:,} B (v5 on the host: {best['v5_bytes']:,}); verified", flush=True)
    result = {"benchmark": "device_coder", "smoke": args.smoke, "device": device,
              "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
              "machine": {"python": platform.python_version(), "platform": platform.platform(),
                          "torch": torch.__version__},
              "elements": total, "memcpy_gbs": memcpy, "rows": rows}
    out = results_path(f"device_coder_{device.split(':')[0]}", args.out, args.smoke)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    try:
        plot(result, out.with_suffix(".png"))
    except ImportError:
        print("(matplotlib missing: no plot)")
    print("\n| change rate | device copy GB/s | diff+code GB/s | x copy | diff ms | code ms | ns/change | "
          "wire bytes | v5 bytes (host) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rate']:.1%} | {memcpy:.1f} | {r['gbs']:.2f} | {r['x_memcpy']:.4f} | {r['diff_s'] * 1e3:.2f} | "
              f"{r['code_s'] * 1e3:.2f} | {r['ns_per_change']:.1f} | {r['wire_bytes']:,} | {r['v5_bytes']:,} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
