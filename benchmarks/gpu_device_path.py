"""The device path on one GPU, in one short run (< 10 minutes on an H100 / H200):

    python benchmarks/gpu_device_path.py --device cuda           # results/gpu_device_path_cuda.json
    python benchmarks/gpu_device_path.py --device cuda --json "$OUT/gpu_device_path_cuda.json"  # a lent machine
    python benchmarks/gpu_device_path.py --device cpu --smoke    # < 2 minutes on CPU tensors (the temp dir)

Three parts, every result checked bit for bit (the checks' time reported apart, never in
a measured time):

a. producer: the real `Producer(wire_version=6, device_coding="gpu")` (on CPU tensors
   "always": the same torch code) over the tensors of a Qwen3-style model of 1.19B
   parameters (benchmarks/qwen3_shapes.py: hidden 2048 and vocabulary 151936 as
   Qwen3-1.7B, 12 of its 28 layers, intermediate 5632), owning every tensor whole; a
   capturing ProducerEnd keeps the payloads. At 1%, 3% and 5% of the elements moved by
   +-1 ULP, the refit's wall time (diff + place + device coding + the payloads' bytes to
   the host) beside a device copy (`copy_`) of the same bytes: the ratio's target is
   >= 0.25. Check: every payload decoded on the host and applied to a host copy of the
   committed bits, then compared with the trainer's weights.
b. refit: a whole refit of a small transformers model (Qwen3, 166M parameters) on the
   device into a Hugging Face receiver in its own process (`nemo-dcr receive --device`,
   the same model class on the same device) over the local transport,
   `TrainerRefit(wire_version=6, device_payloads=True)`, after AdamW steps (lr 1e-5): each
   payload is sealed on the device (the device checksum in its trailer) and reaches the
   receiver by CUDA IPC (on CPU tensors: through shared memory). Check, apart from the
   refit's time: the receiver's whole state, tensor by tensor (`TrainerRefit.verify`),
   against the trainer's, after the commit.
c. decode: baseline-conditioned records (nemo_dcr.wire.conditioned) of N(0, 0.02) BF16
   weights after an AdamW-like step (lr 1e-5 times u ~ N(0, k^2), Adam's m / sqrt(v):
   k 0.05 and 0.15 move about 2% and 5% of the elements), decoded by the host's numba
   pass and by the torch decoder (nemo_dcr.wire.conditioned_device) with the committed
   bits on the device: universe elements/s and changes/s. On a GPU the host decoder
   would first need the universe's bits on the host: that copy is reported beside it.

The run keeps to --budget-s (default 540 s): a part's rows that would not fit are
skipped and named so in the JSON ("skipped"); the estimate printed at the start says how
the time is expected to split.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.outputs import results_path  # noqa: E402
from benchmarks.qwen3_shapes import qwen3_shapes  # noqa: E402
from nemo_dcr import dtypes, kernels  # noqa: E402
from nemo_dcr.baseline import Baseline  # noqa: E402
from nemo_dcr.layout import LocalParam, OwnedRange  # noqa: E402
from nemo_dcr.placement import AffineMap, Piece  # noqa: E402
from nemo_dcr.records import BaseSpan, Op  # noqa: E402
from nemo_dcr.sender import AUTO, Producer  # noqa: E402
from nemo_dcr.records import TransferInfo  # noqa: E402
from nemo_dcr.wire import codec, conditioned  # noqa: E402
from nemo_dcr.wire.conditioned_device import decode_conditioned_device, decode_positions_device  # noqa: E402

TARGET_RATIO = 0.25

# Sizes: (full run, smoke run).
PRODUCER_MODEL = {False: (2048, 12, 151936), True: (256, 1, 1000)}  # qwen3_shapes(hidden, layers, vocab)
REFIT_MODEL = {False: dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                           num_key_value_heads=4, head_dim=128, vocab_size=32000),
               True: dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=300)}
DECODE_UNIVERSES = {False: [1 << 22, 1 << 25], True: [1 << 16]}

# What the estimate assumes (a GPU's; the CPU smoke's in brackets): refit GB/s of weights,
# host check (decode + apply + compare) GB/s of weights plus ns per change, set-up GB/s.
ASSUME = {"cuda": {"refit_gbs": 2.0, "check_gbs": 1.0, "check_ns_per_change": 60.0, "setup_gbs": 0.5,
                   "decode_elements_per_s": 2e8, "refit_part_s": 60.0},
          "cpu": {"refit_gbs": 0.02, "check_gbs": 0.3, "check_ns_per_change": 200.0, "setup_gbs": 0.2,
                  "decode_elements_per_s": 2e7, "refit_part_s": 25.0}}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class KeepingEnd:
    """A ProducerEnd that keeps each payload (no transport cost in the measurement)."""

    def __init__(self):
        self.payloads: list[bytes] = []

    def send(self, transfer, payload_id, data):
        self.payloads.append(data)

    def flush(self, transfer, payload_ids):
        return {}

    def close(self):
        pass


# Each part's rows stop starting past this share of --budget-s: a slow producer leaves the
# refit and the decode their time.
PART_ENDS = {"producer": 0.55, "refit": 0.75, "decode": 1.0}


class Budget:
    """The run's time: what is left of --budget-s, and what was skipped for it."""

    def __init__(self, limit_s: float):
        self.t0, self.limit_s, self.skipped = time.perf_counter(), limit_s, []

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def fits(self, need_s: float, what: str, part: str) -> bool:
        """Whether a row needing ~need_s ends before `part`'s share of the budget ends."""
        end = self.limit_s * PART_ENDS[part]
        if self.elapsed + need_s <= end:
            return True
        self.skipped.append(f"{what} (needs ~{need_s:.0f} s, {end - self.elapsed:.0f} s left to the {part} part)")
        print(f"  [budget] skipped {self.skipped[-1]}", flush=True)
        return False


def device_copy_gbs(nbytes: int, dev: torch.device, repeats: int = 5) -> float:
    """GB/s of a device copy (torch copy_) of nbytes, best of `repeats`."""
    src = torch.ones(nbytes // 2, dtype=torch.int16, device=dev)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        sync(dev)
        t = time.perf_counter()
        dst.copy_(src)
        sync(dev)
        best = min(best, time.perf_counter() - t)
    del src, dst
    return nbytes / best / 1e9


# ---------------------------------------------------------------- a. producer


def producer_plan(smoke: bool) -> dict:
    hidden, layers, vocab = PRODUCER_MODEL[smoke]
    shapes = qwen3_shapes(hidden, layers, vocab)
    elements = sum(int(np.prod(s)) for s in shapes.values())
    return {"shapes": shapes, "elements": elements, "hidden": hidden, "layers": layers, "vocab": vocab,
            "rates": [0.01, 0.03, 0.05], "ops": ["xor", "auto"], "repeats": 2}


def perturb(params: dict[str, torch.Tensor], rate: float, gen: torch.Generator) -> int:
    """+-1 ULP on a random `rate` of every tensor's elements, on their device."""
    changed = 0
    for t in params.values():
        bits = t.view(-1).view(torch.int16)
        idx = torch.nonzero(torch.rand(bits.numel(), device=t.device, generator=gen) < rate).view(-1)
        up = torch.rand(idx.numel(), device=t.device, generator=gen) < 0.5
        bits[idx] += torch.where(up, 1, -1).to(torch.int16)
        changed += idx.numel()
    return changed


def check_payloads(payloads: list[bytes], committed: dict[str, np.ndarray], params: dict[str, torch.Tensor],
                   changed: int) -> float:
    """Decode every payload on the host, apply it to the committed bits, compare with the
    trainer's weights, undo: the seconds it took. Exits on any difference."""
    t = time.perf_counter()
    records = [r for data in payloads for r in codec.decode(data).records]
    undo = []
    for r in records:
        flat, pos = committed[r.name], r.positions.astype(np.int64)
        old = flat[pos]
        vals = r.values.view(np.uint16)
        op = Op(r.op)
        flat[pos] = old ^ vals if op is Op.XOR else (old + vals).astype(np.uint16) if op is Op.ADD else vals
        undo.append((flat, pos, old))
    bad = [n for n, p in params.items()
           if not np.array_equal(committed[n], p.reshape(-1).view(torch.int16).cpu().numpy().view(np.uint16))]
    for flat, pos, old in reversed(undo):
        flat[pos] = old
    got = sum(len(r) for r in records)
    if bad or got != changed:
        sys.exit(f"gpu_device_path: producer refit not bit-exact: {got} changes decoded of {changed}; "
                 f"tensors that differ: {bad[:5]}")
    return time.perf_counter() - t


def producer_part(dev: torch.device, smoke: bool, budget: Budget, assume: dict) -> dict:
    plan = producer_plan(smoke)
    coding = "gpu" if dev.type == "cuda" else "always"
    nbytes = 2 * plan["elements"]
    print(f"[a] producer: {plan['elements']:,} BF16 elements ({nbytes / 2**30:.2f} GiB) in {len(plan['shapes'])} "
          f"tensors on {dev}, Producer(wire_version=6, device_coding={coding!r})", flush=True)
    t = time.perf_counter()
    gen = torch.Generator(device=dev).manual_seed(0)
    params, owned, maps, specs = {}, [], {}, {}
    for name, shape in plan["shapes"].items():
        p = (torch.randn(shape, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
        rows, cols = shape if len(shape) == 2 else (1, shape[0])
        owned.append(OwnedRange(LocalParam(name, shape, torch.bfloat16), 0, p.numel(), p.view(-1)))
        maps[name] = AffineMap(name, p.numel(), (Piece(name, 0, rows, cols, 0, cols),))
        specs[name] = ("BF16", shape)
        params[name] = p
    committed = {n: p.reshape(-1).view(torch.int16).cpu().numpy().view(np.uint16).copy() for n, p in params.items()}
    end = KeepingEnd()
    baseline = Baseline()
    prod = Producer("p0", owned, maps, specs, baseline, end, op=Op.XOR, wire_version=6, device_coding=coding)
    sync(dev)
    setup_s = time.perf_counter() - t

    def restore():
        for n, p in params.items():
            p.view(-1).view(torch.int16).copy_(torch.from_numpy(committed[n].view(np.int16)).to(dev))

    def one_refit(tag: str):
        end.payloads = []
        sync(dev)
        t = time.perf_counter()
        rep = prod.refit(TransferInfo(tag, 0, 1, ("p0",)))
        sync(dev)
        wall = time.perf_counter() - t
        baseline.abort()  # the committed bits stay version 0's for the next refit
        return rep, wall

    # Warm-up (the device mirror of the baseline, kernels, allocator): not measured, but it
    # and each row's refits and checks tell how long the next row takes (at 5%: the most).
    changed = perturb(params, plan["rates"][-1], gen)
    _, per_refit = one_refit("warm-up")
    per_check = check_payloads(end.payloads, committed, params, changed)
    restore()
    rows = []
    for op in plan["ops"]:  # every rate of the first op before the second's, should the budget run short
        for rate in plan["rates"]:
            need = plan["repeats"] * (per_refit + per_check) + 1.0
            if not budget.fits(need, f"producer rate {rate:.0%} op {op}", "producer"):
                continue
            prod.op = AUTO if op == "auto" else Op(op)  # one producer (one baseline, one digest read) for all rows
            changed = perturb(params, rate, gen)
            memcpy = max(device_copy_gbs(nbytes, dev) for _ in range(2))
            best, checks = None, []
            for k in range(plan["repeats"]):
                rep, wall = one_refit(f"t-{rate}-{op}-{k}")
                checks.append(check_payloads(end.payloads, committed, params, changed))
                per_refit, per_check = max(per_refit, wall), max(per_check, checks[-1])  # the warm-up's at 5%: a floor
                if rep.changed_elements != changed:
                    sys.exit(f"gpu_device_path: the producer found {rep.changed_elements} changes, not {changed}")
                if best is None or wall < best["refit_s"]:
                    best = {"refit_s": wall, **{f"{s}_s": rep.times[s] for s in ("diff", "place", "encode", "send")},
                            "wire_bytes": sum(len(d) for d in end.payloads), "payloads": rep.payloads,
                            "scanned_bytes": rep.scanned_bytes, "cpu_s": rep.cpu_s}
            restore()
            gbs = best["scanned_bytes"] / best["refit_s"] / 1e9
            row = {"rate": rate, "op": op, "changed": changed, "memcpy_gbs": memcpy, "refit_gbs": gbs,
                   "ratio_to_memcpy": gbs / memcpy, "meets_target": gbs / memcpy >= TARGET_RATIO,
                   "ns_per_change": best["refit_s"] / changed * 1e9, **best,
                   "bit_exact": True, "verify_s": float(np.median(checks)), "verify_s_all": checks}
            rows.append(row)
            print(f"  rate {rate:4.0%} {op:<4}: {gbs:7.2f} GB/s = {row['ratio_to_memcpy']:.3f} x copy_ "
                  f"({memcpy:.1f} GB/s) [diff {best['diff_s']:.3f} s, place {best['place_s']:.3f} s, "
                  f"encode {best['encode_s']:.3f} s], {best['payloads']} payloads, {best['wire_bytes']:,} B; "
                  f"bit-exact (check {row['verify_s']:.2f} s)", flush=True)
    return {"path": f"Producer(wire_version=6, device_coding={coding!r}) with a capturing ProducerEnd; one producer "
                    "for every row (its op set per row), the baseline aborted after each refit",
            "device_coding": coding,
            "model": {"shapes": f"benchmarks/qwen3_shapes.qwen3_shapes(hidden={plan['hidden']}, layers="
                                f"{plan['layers']}, vocab={plan['vocab']})",
                      "elements": plan["elements"], "bytes": nbytes, "tensors": len(plan["shapes"]),
                      "note": ("a CPU smoke stand-in" if smoke else
                               "Qwen3-1.7B's hidden size and vocabulary, 12 of its 28 layers (intermediate 5632, "
                               "not 6144): 1.19B parameters, every tensor owned whole")},
            "changes": "+-1 ULP on a random `rate` of every tensor's elements",
            "memcpy": "torch copy_ of the weights' bytes on the same device, best of 5 (twice per row, the faster): "
                      "GB/s = the weights' bytes / s; refit GB/s = the weights' bytes / the refit's wall time",
            "target_ratio": TARGET_RATIO, "setup_s": setup_s, "repeats": plan["repeats"], "rows": rows,
            "all_bit_exact": bool(rows) and all(r["bit_exact"] for r in rows)}


# ---------------------------------------------------------------- b. refit into HF


def refit_part(dev: torch.device, smoke: bool, budget: Budget, assume: dict) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen3Config

    from nemo_dcr import registry
    from nemo_dcr.capture import torch_owned_ranges
    from nemo_dcr.checkpoint import read_specs
    from nemo_dcr.layout import ParallelLayout
    from nemo_dcr.trainer import TrainerRefit
    from nemo_dcr.verify import state_digests

    refits = 3
    out = {"transport": "local", "device_payloads": True, "cuda_ipc": dev.type == "cuda",
           "receiver": f"`nemo-dcr receive --device {dev.type}`: its own process", "rows": [], "all_bit_exact": False}
    if not budget.fits(assume["refit_part_s"], "the whole refit part", "refit"):
        return out
    cfg = Qwen3Config(tie_word_embeddings=False, **REFIT_MODEL[smoke])
    tmp = Path(tempfile.mkdtemp(prefix="gdp-"))  # short: the local transport's socket paths live below it
    t = time.perf_counter()
    torch.manual_seed(0)
    ckpt = tmp / "ckpt"
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(ckpt)
    config = {"dir": str(tmp / "shm"), "timeout_s": 120}
    transport = registry.transport("local", config, receivers=["rx0"])
    # CUDA IPC maps memory into another process only: the receiver runs in its own.
    log = tmp / "rx0.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "nemo_dcr.cli", "receive", "--checkpoint", str(ckpt),
                                 "--id", "rx0", "--transport", "local", "--transport-config", json.dumps(config),
                                 "--device", str(dev)], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    refit = None
    try:
        deadline = time.monotonic() + 300
        while "serving version 0" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"gpu_device_path: the receiver did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        specs = read_specs(str(ckpt))
        refit = TrainerRefit(registry.converter("identity", model.config), specs, torch_owned_ranges(model),
                             ParallelLayout(), transport, state_dir=str(tmp / "state"), wire_version=6,
                             device_payloads=True, timeout_s=120)
        coding = "gpu"
        if dev.type != "cuda":  # TrainerRefit's producer codes GPU ranges on the device; on CPU, run that code anyway
            refit.producer.device_coding = coding = "always"
        params = sum(p.numel() for p in model.parameters())
        setup_s = time.perf_counter() - t
        print(f"[b] refit: Qwen3 of {params:,} parameters on {dev} -> a receiver process (HFRuntime on {dev}), "
              f"local transport, TrainerRefit(wire_version=6, device_payloads=True), device_coding {coding!r}, "
              f"payloads {'by CUDA IPC' if dev.type == 'cuda' else 'through shared memory'}", flush=True)
        gen = torch.Generator(device=dev).manual_seed(1)
        for version in range(1, refits + 2):  # the first: warm-up
            ids = torch.randint(0, cfg.vocab_size, (2, 32), device=dev, generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(dev)
            t = time.perf_counter()
            result = refit.refit()
            sync(dev)
            wall = time.perf_counter() - t
            if not result.decision.committed:
                sys.exit(f"gpu_device_path: refit {version} did not commit: {result.decision}")
            t = time.perf_counter()
            # Tensor by tensor: the receiver digests its whole state, compared with the trainer's.
            problems = refit.verify(state_digests({k: v for k, v in model.state_dict().items() if k in specs}))
            if set(problems) != {"rx0"} or any(problems.values()):
                sys.exit(f"gpu_device_path: refit {version} is not bit-exact: {problems}")
            verify_s = time.perf_counter() - t
            m = result.metrics()
            row = {"version": version, "warm_up": version == 1, "refit_wall_s": wall, "bit_exact": True,
                   "verify_s": verify_s, **{k: m[k] for k in m if isinstance(m[k], (int, float, bool))}}
            out["rows"].append(row)
            print(f"  refit {version}{' (warm-up)' if version == 1 else ''}: {wall:.3f} s, "
                  f"{m['changed_elements']:,} changes ({m['change_rate']:.2%}), {m['wire_bytes']:,} B in "
                  f"{m['payloads']} payloads [diff {m['producer_diff_s']:.3f}, encode {m['producer_encode_s']:.3f},"
                  f" transfer {m['producer_transfer_s']:.3f} s]; bit-exact (check {verify_s:.2f} s)", flush=True)
    finally:
        if refit is not None:
            refit.close(shutdown_receivers=True)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        transport.cleanup()
        if dist.is_initialized():
            dist.destroy_process_group()
        out["receiver_log_tail"] = log.read_text(errors="replace")[-2000:]
        shutil.rmtree(tmp, ignore_errors=True)
    measured = [r for r in out["rows"] if not r["warm_up"]]
    out.update({"model": {"config": {"family": "qwen3", "tie_word_embeddings": False, **REFIT_MODEL[smoke]},
                          "parameters": params, "dtype": "BF16"},
                "trainer": "AdamW(lr=1e-5), one step of a random batch (2 x 32 tokens) before each refit",
                "device_coding": coding, "setup_s": setup_s,
                "median_refit_s": float(np.median([r["refit_wall_s"] for r in measured])) if measured else None,
                "all_bit_exact": bool(out["rows"]) and all(r["bit_exact"] for r in out["rows"])})
    return out


# ---------------------------------------------------------------- c. conditioned decode


def adam_like(n: int, k: float, seed: int, lr: float = 1e-5) -> tuple[np.ndarray, np.ndarray]:
    """Old and new BF16 bits of N(0, 0.02) weights after a step lr * u, u ~ N(0, k^2)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02
    step = torch.randn(n, generator=g) * (lr * k)
    old, new = w.to(torch.bfloat16), (w + step).to(torch.bfloat16)
    return dtypes.bits_of(old).numpy().view(np.uint16), dtypes.bits_of(new).numpy().view(np.uint16)


def best_of(fn, repeats: int, dev: torch.device) -> tuple[float, object]:
    """(best seconds of `repeats` calls after an unmeasured one, the last call's result)."""
    fn()  # compiled kernels loaded, the allocator's and the device's first-call costs paid
    best, out = float("inf"), None
    for _ in range(repeats):
        sync(dev)
        t = time.perf_counter()
        out = fn()
        sync(dev)
        best = min(best, time.perf_counter() - t)
    return best, out


def decode_part(dev: torch.device, smoke: bool, budget: Budget, assume: dict) -> dict:
    bf16 = dtypes.from_name("BF16")
    repeats = 3 if smoke else 5
    rows = []
    print(f"[c] conditioned decode: host numba pass vs torch on {dev}", flush=True)
    lo = 1 << 20  # the universe: a span of a larger tensor
    for n in DECODE_UNIVERSES[smoke]:
        per_row = 3 * n / 2e7 + 3 * (repeats + 1) * n / assume["decode_elements_per_s"]  # data, encode, decodes
        for k in (0.05, 0.15):
            if not budget.fits(2 * per_row + n / 1e7, f"decode n={n} k={k}", "decode"):
                continue
            old, new = adam_like(n, k, 1)
            idx = np.flatnonzero(old != new)
            gpos = idx.astype(np.uint64) + np.uint64(lo)
            base = BaseSpan(lo, old)
            bits = torch.from_numpy(old.view(np.int16)).to(dev)  # the receiver's committed bits, on the device
            count = idx.size
            for op in (Op.ADD, Op.XOR):
                t_row = time.perf_counter()
                vals = (new[idx] - old[idx]).astype(np.uint16) if op is Op.ADD else old[idx] ^ new[idx]
                ps, vs = conditioned.encode_conditioned(gpos, vals, bf16, op, base)
                psec, vsec = np.frombuffer(ps, np.uint8), np.frombuffer(vs, np.uint8)
                host_s, (hpos, hvals) = best_of(
                    lambda: conditioned.decode_conditioned(psec, vsec, count, bf16, op, base), repeats, dev)
                dev_s, (dpos, dvals) = best_of(
                    lambda: decode_conditioned_device(psec, vsec, count, bf16, op, lo, bits), repeats, dev)
                dpos_s, _ = best_of(lambda: decode_positions_device(psec, count, bf16, lo, bits), repeats, dev)
                copy_s, _ = best_of(lambda: bits.cpu(), repeats, dev) if dev.type == "cuda" else (0.0, None)
                t = time.perf_counter()
                exact = (np.array_equal(hpos, gpos) and np.array_equal(hvals, vals)
                         and np.array_equal(dpos.cpu().numpy().astype(np.uint64), gpos) and np.array_equal(dvals, vals))
                verify_s = time.perf_counter() - t
                if not exact:
                    sys.exit(f"gpu_device_path: conditioned decode not bit-exact (n={n}, k={k}, op={op.value})")
                row = {"universe": n, "k": k, "op": op.value, "changes": count, "rate": count / n,
                       "positions_bytes": len(ps), "values_bytes": len(vs),
                       "host_s": host_s, "device_s": dev_s, "device_positions_s": dpos_s,
                       "host_needs_bits_copy_s": copy_s,
                       "host_elements_per_s": n / host_s, "device_elements_per_s": n / dev_s,
                       "host_changes_per_s": count / host_s, "device_changes_per_s": count / dev_s,
                       "device_over_host": host_s / dev_s, "bit_exact": True, "verify_s": verify_s}
                rows.append(row)
                per_row = time.perf_counter() - t_row
                print(f"  n={n:>10,} k={k:.2f} {op.value:<3} ({count / n:.2%} changed): host {n / host_s / 1e6:8.1f} "
                      f"M elements/s, device {n / dev_s / 1e6:8.1f} M/s (positions {dpos_s * 1e3:.1f} ms of "
                      f"{dev_s * 1e3:.1f}); x{host_s / dev_s:.2f}; bit-exact", flush=True)
    return {"host": "nemo_dcr.wire.conditioned.decode_conditioned (numba pass over the universe, one thread)",
            "device": "nemo_dcr.wire.conditioned_device.decode_conditioned_device (torch on the bits' device; "
                      "Golomb gaps and rANS values on the host)",
            "data": "N(0, 0.02) BF16 weights, step 1e-5 * u, u ~ N(0, k^2) (Adam's m / sqrt(v))",
            "repeats": repeats, "rows": rows, "all_bit_exact": bool(rows) and all(r["bit_exact"] for r in rows)}


# ---------------------------------------------------------------- main


def estimate(kind: str, smoke: bool) -> dict:
    """Seconds each part is expected to take on a device of this kind ("cuda" or "cpu"),
    at ASSUME's rates; the run's own budget adapts to what its first refits and rows take."""
    a = ASSUME[kind]
    plan = producer_plan(smoke)
    nbytes = 2 * plan["elements"]
    refits = 1 + len(plan["rates"]) * len(plan["ops"]) * plan["repeats"]
    changes = (max(plan["rates"]) + sum(plan["rates"]) * len(plan["ops"]) * plan["repeats"]) * plan["elements"]
    producer = (nbytes / a["setup_gbs"] / 1e9 + refits * nbytes / a["refit_gbs"] / 1e9
                + refits * nbytes / a["check_gbs"] / 1e9 + changes * a["check_ns_per_change"] * 1e-9)
    decode = sum(2 * (3 * n / 2e7) + 4 * 3 * (4 if smoke else 6) * n / a["decode_elements_per_s"]
                 for n in DECODE_UNIVERSES[smoke])
    start = 20.0 if kind == "cuda" else 5.0  # imports, the device's start, the compiled kernels' load
    return {"producer_s": producer, "refit_s": a["refit_part_s"], "decode_s": decode, "start_s": start,
            "total_s": producer + a["refit_part_s"] + decode + start, "assumed": a}


def _estimate_line(est: dict) -> str:
    return (f"~{est['total_s']:.0f} s (producer ~{est['producer_s']:.0f}, refit ~{est['refit_s']:.0f}, decode "
            f"~{est['decode_s']:.0f}, start ~{est['start_s']:.0f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a check that it runs, < 2 minutes on CPU)")
    ap.add_argument("--json", "--out", dest="json", default=None,
                    help="results JSON (default: benchmarks/results/gpu_device_path_<device>.json; with --smoke, "
                         "the temp dir)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting rows past this many seconds (default 540; smoke 110)")
    ap.add_argument("--parts", default="producer,refit,decode")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_device_path: --device cuda needs a CUDA GPU, and torch sees none (try --device cpu --smoke)")
    parts = args.parts.split(",")
    if not set(parts) <= {"producer", "refit", "decode"}:
        sys.exit(f"gpu_device_path: --parts takes producer, refit, decode; got {args.parts!r}")
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    out = results_path(f"gpu_device_path_{args.device}", args.json, args.smoke)
    budget = Budget(args.budget_s if args.budget_s is not None else (110.0 if args.smoke else 540.0))
    est, gpu_est = estimate(args.device, args.smoke), estimate("cuda", False)
    assume = est["assumed"]
    print(f"[gpu_device_path] {args.device}{' smoke' if args.smoke else ''}: expected {_estimate_line(est)}; "
          f"rows stop starting at {budget.limit_s:.0f} s; compiled kernels {kernels.common.HAVE_NUMBA}\n"
          f"  the full run on one GPU (--device cuda): expected {_estimate_line(gpu_est)}, rows stop starting "
          f"at 540 s, so it ends within 10 minutes", flush=True)
    # Host-side torch ops on one thread, as the host decoder's numba pass: on a shared machine an
    # intra-op pool waits for cores other jobs hold (a 2.5 MB CPU copy_ read 0.2 GB/s on two).
    torch.set_num_threads(1)
    load_before = list(os.getloadavg())
    result = {"benchmark": "gpu_device_path", "smoke": args.smoke, "device": args.device,
              "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
              "gpu_memory_gib": torch.cuda.get_device_properties(dev).total_memory / 2**30 if dev.type == "cuda"
              else None,
              "cuda": torch.version.cuda, "torch_threads": torch.get_num_threads(), "compiled_kernels": kernels.common.HAVE_NUMBA}
    timings = {}

    def write(done: bool) -> None:
        """The JSON so far: after each part too, so that a run stopped from outside keeps
        what it measured."""
        result["budget"] = {"limit_s": budget.limit_s, "part_ends": PART_ENDS, "estimate": est,
                            "gpu_full_run_estimate": gpu_est, "elapsed_s": budget.elapsed, **timings,
                            "skipped": budget.skipped}
        result["complete"] = done
        result["all_verified"] = done and all(result[p].get("all_bit_exact") for p in parts)
        result["machine"] = machine_info(load_average_before=load_before, load_average=list(os.getloadavg()))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=float))

    for part, fn in (("producer", producer_part), ("refit", refit_part), ("decode", decode_part)):
        if part not in parts:
            continue
        t = time.perf_counter()
        try:
            result[part] = fn(dev, args.smoke, budget, assume)
        except (Exception, SystemExit) as e:  # a failed part (or check) is reported; the others still run
            import traceback
            print(f"[{part}] FAILED: {e!r}", flush=True)
            result[part] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:],
                            "rows": [], "all_bit_exact": False}
        timings[f"{part}_s"] = time.perf_counter() - t
        if dev.type == "cuda":
            result[part]["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
            torch.cuda.reset_peak_memory_stats(dev)
            torch.cuda.empty_cache()
        write(False)
    write(True)

    if "producer" in parts:
        print("\n| rate | op | refit GB/s | copy_ GB/s | x copy_ | target met | diff s | place s | encode s | "
              "wire bytes | check s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in result["producer"]["rows"]:
            print(f"| {r['rate']:.0%} | {r['op']} | {r['refit_gbs']:.2f} | {r['memcpy_gbs']:.1f} | "
                  f"{r['ratio_to_memcpy']:.3f} | {'yes' if r['meets_target'] else 'no'} | {r['diff_s']:.3f} | "
                  f"{r['place_s']:.3f} | {r['encode_s']:.3f} | {r['wire_bytes']:,} | {r['verify_s']:.2f} |")
    if "refit" in parts:
        print("\n| refit | wall s | changes | rate | wire bytes | payloads | diff s | encode s | transfer s | "
              "check s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in result["refit"]["rows"]:
            print(f"| {r['version']}{' (warm-up)' if r['warm_up'] else ''} | {r['refit_wall_s']:.3f} | "
                  f"{r['changed_elements']:,} | {r['change_rate']:.2%} | {r['wire_bytes']:,} | {r['payloads']} | "
                  f"{r['producer_diff_s']:.3f} | {r['producer_encode_s']:.3f} | {r['producer_transfer_s']:.3f} | "
                  f"{r['verify_s']:.2f} |")
        print(f"device payloads: {result['refit'].get('device_payloads')}, by CUDA IPC: "
              f"{result['refit'].get('cuda_ipc')}")
    if "decode" in parts:
        print("\n| universe | k | op | changed | host M el/s | device M el/s | host M changes/s | "
              "device M changes/s | device / host | bits to host s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in result["decode"]["rows"]:
            print(f"| {r['universe']:,} | {r['k']} | {r['op']} | {r['rate']:.2%} | "
                  f"{r['host_elements_per_s'] / 1e6:.1f} | {r['device_elements_per_s'] / 1e6:.1f} | "
                  f"{r['host_changes_per_s'] / 1e6:.2f} | {r['device_changes_per_s'] / 1e6:.2f} | "
                  f"{r['device_over_host']:.2f} | {r['host_needs_bits_copy_s']:.4f} |")
    print(f"\nall verified: {result['all_verified']}; {budget.elapsed:.0f} s of {budget.limit_s:.0f}"
          f"{'; skipped: ' + '; '.join(budget.skipped) if budget.skipped else ''}\nwrote {out}")
    if not result["all_verified"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
