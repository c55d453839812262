"""Scaling of a refit end to end: time vs model size at a fixed change rate, time vs change
rate at a fixed size, each beside a dense refit through the same transport, and the change
rate where the dense refit becomes the cheaper one.

    sudo python benchmarks/scaling.py     # ~10-15 min on 2 busy cores; results/scaling.{json,png}
    python benchmarks/scaling.py --links local          # no root: same-host shared memory only
    python benchmarks/scaling.py --smoke  # about a minute: tiny models, local transport (CI smoke)

Links (--links, each runs the whole sweep): `local` (shared memory + ZeroMQ ipc on one
host), `relay` (the ZeroMQ relay tree over TCP loopback) and `relay@MBIT`: the relay tree
over a loopback shaped to MBIT Mbit/s (root: the whole run then executes inside a private
network namespace whose loopback has a `tc tbf` qdisc, as benchmarks/e2e_link.py does; one
TCP stream over it is measured and reported). Default: local,relay@1000.

Set-up. The trainer runs here (a one-process gloo group); the receivers are separate
processes (--receivers, default 1) started by this script in receiver mode.
* Model: BF16 tensors of a Qwen3-style decoder scaled to each size (`model_shapes`:
  embedding, untied head, per layer q/k/v/o, gate/up/down and four norms), filled with
  slices of one seeded pool of 16M N(0, 0.02) values, repeated at shifted offsets (norms
  1 + N(0, 0.05)); trainer and receivers build the same bits.
* Delta refit, the library path: `TrainerRefit` (identity converter, the whole model owned
  by one producer, op "auto") diffs the trainer's tensors against its committed baseline,
  places, encodes and streams payloads through the transport; each receiver is the real
  `nemo_dcr.receiver.Receiver` over a `TensorStoreRuntime` of canonical tensors (validate,
  stage, apply in place with an undo log), then the joint commit. Timed: `refit()`, i.e.
  begin -> diff/place/encode/send -> every receiver applied -> commit record written.
* Changes: before each refit, a Bernoulli(rate) subset of every tensor's elements moves by
  +-1 ULP on the trainer (the exact count is reported and checked against the producer's).
* Dense refit, the reference, measured right after each delta refit in the same processes
  over the same transport: the whole checkpoint's BF16 bytes in 4 MiB payloads (every
  element sent; no diff, no codec, no checksum, no commit record, no undo log: the
  cheapest full-checkpoint refit the transport allows), announced with a begin; each
  receiver copies a payload into its tensor before acknowledging it. Timed: begin -> the
  last payload applied on every receiver. It rewrites the bits the delta refit produced.
* Verification after every refit (both kinds), timed apart: per-tensor BLAKE2b digests
  of the trainer's tensors against every receiver's (`TrainerRefit.verify`).
* One unreported warm-up refit (0.1%) per model and link (kernel compilation, planning).
* Repeats: --repeats refits per point for the rate sweep's model (rates cycled, so the
  repeats of a point are spread over time), --size-repeats for the other models; the
  repeat with the median delta time is reported (all of them are in "points").
* Crossover: the change rate where delta time = dense time, interpolated linearly in
  log(rate) vs log(delta / dense) between the two measured rates around it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.outputs import results_path  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.shaped_link import measure_link, run_shaped  # noqa: E402
from tests.support.launch import free_port  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

CHUNK = 2 << 20  # BF16 elements per dense payload (4 MiB)
SEED = 1234
NOT_ROOT = "scaling: a shaped link (relay@MBIT) needs root (ip netns, tc); or drop it from --links"


def log(msg: str) -> None:
    print(f"[scaling] {msg}", flush=True)


# --- the model ----------------------------------------------------------------------------

def model_shapes(target: float) -> dict[str, tuple[int, ...]]:
    """A Qwen3-style decoder of about `target` parameters: hidden h (a multiple of 128),
    vocab 8h, FFN 2.75h, KV heads half the query heads (head dim 128), untied head."""
    h = 128 * max(1, round(math.sqrt(target / 90) / 128))
    vocab, ffn, hd = 8 * h, int(2.75 * h) // 64 * 64, min(128, h)
    per_layer = 2 * h * h + 2 * (h // 2) * h + 3 * ffn * h
    layers = max(1, round((target - 2 * vocab * h) / per_layer))
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (h // 2, h),
                       p + "self_attn.v_proj.weight": (h // 2, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                       p + "mlp.down_proj.weight": (h, ffn)})
    return shapes


def build_model(shapes: dict[str, tuple[int, ...]], seed: int = SEED) -> dict[str, torch.Tensor]:
    """The same BF16 bits in every process: slices of one seeded N(0, 0.02) pool (drawing
    a billion normals per process would take minutes on a busy core)."""
    g = torch.Generator().manual_seed(seed)
    pool = (0.02 * torch.randn(1 << 24, generator=g)).to(torch.bfloat16)
    norm_pool = (1 + 2.5 * pool[: 1 << 16].float()).to(torch.bfloat16)
    out, cursor = {}, 0
    for name, shape in shapes.items():
        src = norm_pool if len(shape) == 1 else pool
        t = torch.empty(shape, dtype=torch.bfloat16)
        flat, n, i = t.view(-1), t.numel(), 0
        while i < n:
            lo = cursor % src.numel()
            k = min(n - i, src.numel() - lo)
            flat[i:i + k].copy_(src[lo:lo + k])
            i, cursor = i + k, cursor + k + 7919  # a different alignment per tensor / wrap
        out[name] = t
    return out


def perturb(tensors: dict[str, torch.Tensor], rate: float, rng: np.random.Generator) -> int:
    """Move a Bernoulli(`rate`) subset of every tensor's elements by +-1 ULP; returns how many."""
    changed = 0
    for name in sorted(tensors):
        bits = tensors[name].view(-1).view(torch.int16).numpy()
        n = bits.size
        if rate >= 1.0:
            bits += (rng.integers(0, 2, n, dtype=np.int16) * 2 - 1).astype(np.int16)
            changed += n
            continue
        if rate >= 0.2:
            pos = np.flatnonzero(rng.random(n, dtype=np.float32) < rate)
        else:
            gaps = rng.geometric(rate, size=int(n * rate + 6 * math.sqrt(n * rate) + 16))
            pos = np.cumsum(gaps) - 1
            while pos.size and pos[-1] < n:  # (practically never) draw more
                pos = np.concatenate([pos, pos[-1] + np.cumsum(rng.geometric(rate, size=1024))])
            pos = pos[pos < n]
        bits[pos] += (rng.integers(0, 2, pos.size, dtype=np.int16) * 2 - 1).astype(np.int16)
        changed += pos.size
    return changed


def dense_plan(shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, int, int]]:
    """(tensor, first element, end) of each dense payload, the same on both sides."""
    plan = []
    for name in sorted(shapes):
        n = math.prod(shapes[name])
        plan += [(name, lo, min(lo + CHUNK, n)) for lo in range(0, n, CHUNK)]
    return plan


def transport_config(name: str, receivers: list[str], work: Path, timeout_s: float) -> dict:
    if name == "local":
        return {"dir": str(work / "shm"), "timeout_s": timeout_s, "max_in_flight_bytes": 256 << 20}
    return {"nodes": [{"id": r, "endpoint": f"tcp://127.0.0.1:{free_port()}"} for r in receivers],
            "coordinator": f"tcp://127.0.0.1:{free_port()}", "fanout": 2, "timeout_s": timeout_s,
            "max_in_flight_bytes": 256 << 20}


# --- receiver process -----------------------------------------------------------------------

def receiver_main(args) -> int:
    """A receiver: the library's Receiver over a TensorStoreRuntime, plus the dense path
    (transfers whose id starts with "dense-": raw BF16 chunks copied in place)."""
    from nemo_dcr import registry
    from nemo_dcr.receiver import Receiver
    from nemo_dcr.runtimes.store import TensorStoreRuntime

    torch.set_num_threads(1)
    shapes = model_shapes(args.params)
    tensors = build_model(shapes)
    plan = dense_plan(shapes)
    runtime = TensorStoreRuntime(tensors)
    end = registry.transport(args.transport, json.loads(args.config)).receiver(args.id)
    receiver = Receiver(args.id, runtime, end, log=lambda m: print(m, flush=True))
    print(f"[{args.id}] ready: {sum(t.numel() for t in tensors.values()):,} params", flush=True)
    dense = {}  # transfer id -> seconds spent copying
    try:
        while True:
            ev = end.poll(0.05)
            if ev is None:
                continue
            tid = str(ev.meta.get("transfer_id", ""))
            if not tid.startswith("dense-"):
                if not receiver.handle(ev):
                    break
                continue
            try:
                if ev.kind == "begin":
                    dense[tid] = 0.0
                    end.reply("ready", {"transfer_id": tid, "error": None})
                elif ev.kind == "payload":
                    t = time.perf_counter()
                    name, lo, hi = plan[int(ev.meta["payload_id"].rsplit("-", 1)[1])]
                    dst = runtime.tensors[name].view(-1).view(torch.int16).numpy()[lo:hi]
                    src = np.frombuffer(ev.data, dtype=np.int16)
                    error = None if src.size == dst.size else f"{src.size} elements for {dst.size}"
                    if error is None:
                        np.copyto(dst, src)
                    del src, dst  # the buffer must be free before the event releases it
                    dense[tid] = dense.get(tid, 0.0) + time.perf_counter() - t
                    end.staged(tid, ev.meta["producer_id"], ev.meta["payload_id"], error)
                elif ev.kind == "manifest":
                    print("DENSE " + json.dumps({"transfer_id": tid, "copy_s": dense.get(tid, 0.0)}), flush=True)
            finally:
                ev.release()
    finally:
        end.close()
    print(f"[{args.id}] shut down at version {receiver.serving_version}", flush=True)
    return 0


# --- trainer side ---------------------------------------------------------------------------

class Session:
    """One model size: trainer tensors, receiver processes, a TrainerRefit."""

    def __init__(self, args, params: float, work: Path):
        from nemo_dcr import registry
        from nemo_dcr.layout import LocalParam, OwnedRange, ParallelLayout
        from nemo_dcr.sender import AUTO
        from nemo_dcr.trainer import TrainerRefit

        self.work, self.timeout = work, args.timeout
        work.mkdir(parents=True, exist_ok=True)
        self.shapes = model_shapes(params)
        self.ids = [f"rx{i}" for i in range(args.receivers)]
        self.config = transport_config(args.transport, self.ids, work, args.timeout)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.logs = [work / f"{rx}.log" for rx in self.ids]
        self.procs = []
        for rx, lf in zip(self.ids, self.logs):
            with open(lf, "wb") as f:
                self.procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--receiver", "--params", str(params), "--transport", args.transport,
                     "--config", json.dumps(self.config), "--id", rx], cwd=REPO, env=env, stdout=f,
                    stderr=subprocess.STDOUT))
        t = time.perf_counter()
        self.tensors = build_model(self.shapes)
        self.params = sum(t.numel() for t in self.tensors.values())
        self.dense_bytes = 2 * self.params
        self.plan = dense_plan(self.shapes)
        self._wait("ready", 900)
        transport = registry.transport(args.transport, self.config, receivers=self.ids)
        specs = {n: ("BF16", tuple(s)) for n, s in self.shapes.items()}
        owned = [OwnedRange(LocalParam(n, tuple(t.shape), t.dtype), 0, t.numel(), t.view(-1))
                 for n, t in self.tensors.items()]
        self.refit = TrainerRefit(registry.converter("identity", None), specs, owned, ParallelLayout(), transport,
                                  state_dir=str(work / "state"), op=AUTO, max_payload_elements=1 << 21,
                                  timeout_s=args.timeout)
        self.setup_s = time.perf_counter() - t
        self.rng = np.random.default_rng(SEED)

    def _wait(self, marker: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            texts = [p.read_text(errors="replace") if p.exists() else "" for p in self.logs]
            if all(marker in t for t in texts):
                return
            for proc, text in zip(self.procs, texts):
                if proc.poll() is not None:
                    raise RuntimeError(f"a receiver exited {proc.returncode}:\n{text[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"receivers not {marker} within {timeout} s")
            time.sleep(0.1)

    def verify(self) -> tuple[bool, float, list]:
        from nemo_dcr.verify import state_digests

        t = time.perf_counter()
        mismatches = self.refit.verify(state_digests(self.tensors))
        bad = [f"{rx}: {m[:3]}" for rx, m in mismatches.items() if m]
        return not bad and len(mismatches) == len(self.ids), time.perf_counter() - t, bad

    def delta(self, rate: float) -> dict:
        changed = perturb(self.tensors, rate, self.rng)
        result = self.refit.refit()
        m = result.metrics()
        exact, verify_s, bad = self.verify()
        if result.changed_elements != changed:
            raise RuntimeError(f"the producer found {result.changed_elements} changes, {changed} were made")
        stages = {k[:-2]: m[k] for k in (
            "producer_diff_s", "producer_place_s", "producer_encode_s", "producer_send_s", "producer_flush_s",
            "producer_transfer_s", "receiver_stage_s", "receiver_apply_s", "coordinator_prepare_s",
            "coordinator_wait_applied_s", "coordinator_commit_s") if k in m}
        return {"refit_s": m["refit_s"], "changed_elements": changed, "change_rate": m["change_rate"],
                "scanned_bytes": sum(p["scanned_bytes"] for p in result.producers), "wire_bytes": m["wire_bytes"],
                "payloads": m["payloads"], "compression": m["compression"], "stages": stages,
                "bit_exact": exact, "verify_s": verify_s, "mismatches": bad}

    def dense(self) -> dict:
        """Every element's bits, raw, through the same transport; copied in place by the receivers."""
        from nemo_dcr.records import TransferInfo

        coord, prod = self.refit.coordinator.end, self.refit.end
        info = TransferInfo(f"dense-{uuid.uuid4().hex[:10]}", 0, 1, ("p0",))
        flat = {n: t.view(-1).view(torch.int16).numpy() for n, t in self.tensors.items()}
        t0 = time.perf_counter()
        coord.broadcast("begin", {"transfer_id": info.transfer_id, "transfer": info.to_json()})
        coord.collect("ready", info.transfer_id, self.timeout)
        t1 = time.perf_counter()
        ids = []
        for name, lo, hi in self.plan:
            ids.append(f"p0-{len(ids):06d}")
            prod.send(info, ids[-1], memoryview(flat[name][lo:hi].view(np.uint8)))
        t2 = time.perf_counter()
        rejected = prod.flush(info, ids)
        t3 = time.perf_counter()
        if rejected:
            raise RuntimeError(f"dense refit rejected: {str(rejected)[:500]}")
        exact, verify_s, bad = self.verify()
        return {"dense_s": t3 - t0, "dense_stages": {"begin_s": t1 - t0, "send_s": t2 - t1, "flush_s": t3 - t2},
                "dense_transfer_id": info.transfer_id, "dense_payloads": len(ids), "dense_bit_exact": exact,
                "dense_verify_s": verify_s, "dense_mismatches": bad}

    def close(self) -> dict[str, float]:
        """Shut the receivers down; the receivers' dense copy seconds by transfer id (slowest)."""
        copy: dict[str, float] = {}
        try:
            self.refit.close(shutdown_receivers=True)
        finally:
            for p in self.procs:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
            for lf in self.logs:
                for line in lf.read_text(errors="replace").splitlines():
                    if line.startswith("DENSE "):
                        d = json.loads(line[6:])
                        copy[d["transfer_id"]] = max(copy.get(d["transfer_id"], 0.0), d["copy_s"])
            shutil.rmtree(self.work, ignore_errors=True)
        return copy


def crossover(rows: list[dict], key: str = "rate") -> tuple[float | None, str]:
    """Where delta time = dense time, interpolated linearly in log(key) vs log(delta / dense).

    key "rate": the change rate above which the dense refit is cheaper (the first point
    where delta / dense goes from < 1 to >= 1 as the rate grows). key "params": the model
    size above which the delta refit is cheaper (delta / dense from >= 1 to < 1)."""
    fmt = (lambda v: f"{v:.2%}") if key == "rate" else (lambda v: f"{v / 1e6:.1f}M params")  # noqa: E731
    pts = sorted((r[key], r["refit_s"] / r["dense_s"]) for r in rows)
    if not pts:
        return None, "no points"
    for (r0, q0), (r1, q1) in zip(pts, pts[1:]):
        if (q0 < 1 <= q1) if key == "rate" else (q0 >= 1 > q1):
            f = (0 - math.log(q0)) / (math.log(q1) - math.log(q0))
            x = math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0)))
            return x, f"between {fmt(r0)} (delta/dense {q0:.2f}) and {fmt(r1)} ({q1:.2f})"
    span = f"({fmt(pts[0][0])} to {fmt(pts[-1][0])})"
    if key == "rate" and pts[0][1] >= 1:
        return None, f"the dense refit is already cheaper at the lowest rate measured {span}"
    if key != "rate" and pts[0][1] < 1:
        return None, f"the delta refit is already cheaper at the smallest model measured {span}"
    cheaper = "delta" if pts[-1][1] < 1 else "dense"
    return None, f"the {cheaper} refit is cheaper at every point measured {span}"


def median_rows(points: list[dict]) -> list[dict]:
    """One row per (params, rate): delta and dense seconds are the medians over the
    repeats (each kind's median repeat supplies its stage breakdown and verification);
    every repeat is listed, and all of them are in the results' "points"."""
    groups: dict[tuple, list[dict]] = {}
    for r in points:
        groups.setdefault((r["params"], r["rate"]), []).append(r)
    out = []
    for _, g in sorted(groups.items()):
        row = dict(sorted(g, key=lambda r: r["refit_s"])[(len(g) - 1) // 2])
        dense = sorted(g, key=lambda r: r["dense_s"])[(len(g) - 1) // 2]
        row.update({k: v for k, v in dense.items() if k.startswith("dense_")})
        row["refit_s_repeats"] = [r["refit_s"] for r in g]
        row["dense_s_repeats"] = [r["dense_s"] for r in g]
        row["ratio_delta_over_dense"] = row["refit_s"] / row["dense_s"]
        row.pop("repeat", None)
        out.append(row)
    return out


def summarize(links: list[dict], points: list[dict], size_params: list[int], rates: list[float], size_rate: float,
              rate_params: int) -> list[dict]:
    """Per link: the size sweep (at `size_rate`) and the rate sweep (at `rate_params`),
    each with its crossover."""
    out = []
    for ln in links:
        mine = [r for r in points if r["link"] == ln["name"]]
        size_rows = median_rows([r for r in mine if r["rate"] == size_rate and r["params"] in size_params])
        rate_rows = median_rows([r for r in mine if r["params"] == rate_params and r["rate"] in rates])
        x, note = crossover(rate_rows)
        sx, snote = crossover(size_rows, "params")
        out.append({**ln, "size_sweep": {"rate": size_rate, "rows": size_rows, "crossover_params": sx,
                                         "crossover_note": snote},
                    "rate_sweep": {"params": rate_params, "rows": rate_rows, "crossover_rate": x,
                                   "crossover_note": note}})
    return out


def parse_links(spec: str) -> list[dict]:
    """"local", "relay" or "relay@MBIT" (relay over the loopback shaped to MBIT Mbit/s)."""
    links = []
    for item in spec.split(","):
        name, _, mbit = item.strip().partition("@")
        if name not in ("local", "relay") or (mbit and name != "relay"):
            raise SystemExit(f"scaling: unknown link {item!r} (local, relay or relay@MBIT)")
        links.append({"name": item.strip(), "transport": name, "mbit": int(mbit) if mbit else 0})
    shaped = {ln["mbit"] for ln in links if ln["mbit"]}
    if len(shaped) > 1:
        raise SystemExit(f"scaling: one shaped rate per run (one loopback), got {sorted(shaped)}")
    return links


def run(args) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    links = parse_links(args.links)
    sizes = [float(s) for s in args.sizes.split(",")]
    rates = sorted(float(r) for r in args.rates.split(","))
    sessions: dict[float, list[float]] = {s: [args.size_rate] for s in sizes}
    sessions[args.rate_size] = sorted(set(sessions.get(args.rate_size, [])) | set(rates))
    work = Path(tempfile.mkdtemp(prefix="nemo-dcr-scaling-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=0, world_size=1)
    t_start = time.perf_counter()
    points: list[dict] = []
    for ln in links:
        ln["link_gbps_measured"] = measure_link(64 << 20) / 1e9 if ln["mbit"] else None
    log(f"links {[ln['name'] for ln in links]}"
        + "".join(f"; {ln['name']}: one TCP stream {ln['link_gbps_measured']:.3f} Gbit/s" for ln in links if ln["mbit"])
        + f"; {args.receivers} receiver process(es); sizes {sizes} at {args.size_rate:.1%}; "
          f"rates {rates} at {args.rate_size:.3g} params")
    try:
        for size in sorted(sessions):
            for ln in links:
                args.transport = ln["transport"]
                s = Session(args, size, work / f"{ln['transport']}-{int(size)}")
                try:
                    log(f"[{ln['name']}] model {s.params / 1e6:.1f}M params ({s.dense_bytes / 1e9:.3f} GB BF16, "
                        f"{len(s.shapes)} tensors): set up in {s.setup_s:.1f} s; warm-up refit at 0.1%")
                    s.delta(0.001)
                    # Repeats outermost: each point's repeats are spread over the session's time.
                    for rep in range(args.repeats if size == args.rate_size else args.size_repeats):
                        for rate in sessions[size]:
                            row = {"link": ln["name"], "params": s.params, "dense_bytes": s.dense_bytes, "rate": rate,
                                   "repeat": rep, "load_average_1m": os.getloadavg()[0]}
                            row.update(s.delta(rate))
                            row.update(s.dense())
                            row["ratio_delta_over_dense"] = row["refit_s"] / row["dense_s"]
                            points.append(row)
                            st = row["stages"]
                            log(f"  [{ln['name']}] {s.params / 1e6:7.1f}M {rate:7.2%}: delta {row['refit_s']:6.2f} s "
                                f"[diff {st['producer_diff']:.2f} place {st['producer_place']:.2f} "
                                f"encode {st['producer_encode']:.2f} transfer {st['producer_transfer']:.2f} "
                                f"rx stage {st['receiver_stage']:.2f} apply {st['receiver_apply']:.2f}] "
                                f"wire {row['wire_bytes'] / 1e6:7.2f} MB | dense {row['dense_s']:6.2f} s "
                                f"-> delta/dense {row['ratio_delta_over_dense']:.2f}; bit-exact "
                                f"{row['bit_exact'] and row['dense_bit_exact']} (verify {row['verify_s']:.2f} / "
                                f"{row['dense_verify_s']:.2f} s; load {row['load_average_1m']:.1f})")
                finally:
                    copy = s.close()
                    for row in points:
                        if row.get("dense_transfer_id") in copy:
                            row["dense_stages"]["receiver_copy_s"] = copy[row["dense_transfer_id"]]
    finally:
        dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)

    out_links = summarize(links, points, [model_params(x) for x in sizes], rates, args.size_rate,
                          model_params(args.rate_size))
    for ln in out_links:
        x, note = ln["rate_sweep"]["crossover_rate"], ln["rate_sweep"]["crossover_note"]
        sx, snote = ln["size_sweep"]["crossover_params"], ln["size_sweep"]["crossover_note"]
        log(f"[{ln['name']}] crossover at {ln['rate_sweep']['params'] / 1e6:.1f}M params: "
            + (f"{x:.2%} ({note})" if x is not None else f"none ({note})")
            + f"; at {args.size_rate:.1%}: " + (f"{sx / 1e6:.1f}M params ({snote})" if sx is not None else snote))
    result = {
        "benchmark": "scaling", "smoke": args.smoke, "receivers": args.receivers, "repeats": args.repeats,
        "size_repeats": args.size_repeats,
        "parameters": {"size_params": [model_params(x) for x in sizes], "size_rate": args.size_rate,
                       "rate_params": model_params(args.rate_size), "rates": rates},
        "dense_reference": "the whole checkpoint's BF16 bytes in 4 MiB payloads through the same transport, "
                           "each copied in place into the receivers' tensors (no diff, no codec); "
                           "timed begin -> every payload applied on every receiver",
        "links": out_links, "points": points, "wall_s": time.perf_counter() - t_start,
        "machine": machine_info(load_average_end=list(os.getloadavg())),
    }
    out = results_path("scaling", args.out, args.smoke)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print_tables(result)
    log(f"wrote {out} and {out.with_suffix('.png')} in {result['wall_s']:.0f} s")
    exact = all(r["bit_exact"] and r["dense_bit_exact"] for r in points)
    return 0 if exact else 1


def model_params(target: float) -> int:
    return sum(math.prod(s) for s in model_shapes(target).values())


def print_tables(result: dict) -> None:
    head = ("| link | params | change rate | changed elements | scanned bytes | wire bytes | delta refit | diff / "
            "place / encode | transfer | rx stage / apply | verify | dense refit | dense verify | delta / dense |")
    sep = "|" + "---|" * 14

    def line(r):
        st = r["stages"]
        return (f"| {r['link']} | {r['params'] / 1e6:.1f}M | {r['change_rate']:.2%} | {r['changed_elements']:,} | "
                f"{r['scanned_bytes']:,} | {r['wire_bytes']:,} | {r['refit_s']:.2f} s | "
                f"{st['producer_diff']:.2f} / {st['producer_place']:.2f} / {st['producer_encode']:.2f} | "
                f"{st['producer_transfer']:.2f} | {st['receiver_stage']:.2f} / {st['receiver_apply']:.2f} | "
                f"{r['verify_s']:.2f} s | {r['dense_s']:.2f} s | {r['dense_verify_s']:.2f} s | "
                f"{r['ratio_delta_over_dense']:.2f} |")

    links = result["links"]
    print(f"\nSize sweep at {links[0]['size_sweep']['rate']:.1%}:\n{head}\n{sep}")
    for ln in links:
        for r in ln["size_sweep"]["rows"]:
            print(line(r))
    print(f"\nRate sweep at {links[0]['rate_sweep']['params'] / 1e6:.1f}M params:\n{head}\n{sep}")
    for ln in links:
        for r in ln["rate_sweep"]["rows"]:
            print(line(r))
    for ln in links:
        x, sx = ln["rate_sweep"]["crossover_rate"], ln["size_sweep"]["crossover_params"]
        print(f"crossover [{ln['name']}]: change rate " + (f"{x:.2%}" if x is not None else "none")
              + f" ({ln['rate_sweep']['crossover_note']}); model size "
              + (f"{sx / 1e6:.1f}M" if sx is not None else "none") + f" ({ln['size_sweep']['crossover_note']})")
    print(flush=True)


def _label(ln: dict) -> str:
    if ln["mbit"]:
        return f"{ln['transport']}, {ln['mbit']} Mbit/s link"
    return f"{ln['transport']}" + (" (shared memory)" if ln["transport"] == "local" else " (loopback)")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = ["#2a7", "#27c", "#c72", "#a3a"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, ln in enumerate(result["links"]):
        c = colors[i % len(colors)]
        rows = ln["size_sweep"]["rows"]
        p = [r["params"] for r in rows]
        a.plot(p, [r["refit_s"] for r in rows], "o-", color=c, label=f"delta, {_label(ln)}")
        a.plot(p, [r["dense_s"] for r in rows], "s--", color=c, alpha=0.7, label=f"dense, {_label(ln)}")
        rows = ln["rate_sweep"]["rows"]
        x = [r["rate"] for r in rows]
        b.plot(x, [r["refit_s"] for r in rows], "o-", color=c, label=f"delta, {_label(ln)}")
        b.plot(x, [r["dense_s"] for r in rows], "s--", color=c, alpha=0.7, label=f"dense, {_label(ln)}")
        cx = ln["rate_sweep"]["crossover_rate"]
        if cx is not None:
            b.axvline(cx, color=c, lw=1, ls=":")
            b.annotate(f"crossover {cx:.2%}", (cx, 0.03 + 0.07 * i), xycoords=("data", "axes fraction"),
                       xytext=(4, 0), textcoords="offset points", color=c, fontsize=8)
        else:
            b.annotate(f"{_label(ln)}: no crossover, {ln['rate_sweep']['crossover_note'].split(' (')[0]}",
                       (0.02, 0.97 - 0.06 * i), xycoords="axes fraction", color=c, fontsize=7, va="top")
        sx = ln["size_sweep"]["crossover_params"]
        if sx is not None:
            a.axvline(sx, color=c, lw=1, ls=":")
            a.annotate(f"crossover {sx / 1e6:.0f}M", (sx, 0.03 + 0.07 * i), xycoords=("data", "axes fraction"),
                       xytext=(4, 0), textcoords="offset points", color=c, fontsize=8)
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("parameters")
    a.set_ylabel("refit seconds")
    a.set_title(f"time vs model size, {result['links'][0]['size_sweep']['rate']:.0%} of elements changed", fontsize=10)
    a.grid(alpha=0.3, which="both")
    a.legend(fontsize=7)
    b.set_xscale("log")
    b.set_yscale("log")
    b.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.1%}".replace(".0%", "%")))
    b.set_xlabel("change rate (share of elements moved by ±1 ULP)")
    b.set_ylabel("refit seconds")
    b.set_title(f"time vs change rate, {result['links'][0]['rate_sweep']['params'] / 1e6:.0f}M params "
                "(dotted: crossover)", fontsize=10)
    b.grid(alpha=0.3, which="both")
    b.legend(fontsize=7, loc="center left")
    fig.suptitle(f"Delta refit vs dense refit (full checkpoint) end to end, BF16, {result['receivers']} receiver "
                 "process(es), same transport each", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def resummarize(args) -> int:
    """Sweeps, crossovers, tables and plot again from the raw points of an earlier results file."""
    path = Path(args.resummarize)
    result = json.loads(path.read_text())
    p = result["parameters"]
    links = [{k: v for k, v in ln.items() if k not in ("size_sweep", "rate_sweep")} for ln in result["links"]]
    result["links"] = summarize(links, result["points"], p["size_params"], p["rates"], p["size_rate"],
                                p["rate_params"])
    out = Path(args.out) if args.out else path
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print_tables(result)
    log(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny models, local transport, seconds (CI)")
    ap.add_argument("--out", help="results JSON (default benchmarks/results/scaling.json; with --smoke, the temp dir)")
    ap.add_argument("--resummarize", metavar="JSON", help="redo sweeps, crossovers, tables and plot from the raw "
                    "points of an earlier results file (written back to it unless --out is given)")
    ap.add_argument("--links", default="local,relay@1000",
                    help="comma-separated: local (shared memory), relay (TCP loopback), relay@MBIT (loopback shaped "
                         "to MBIT Mbit/s with tc tbf inside a network namespace: root)")
    ap.add_argument("--sizes", default="16e6,64e6,256e6,1e9", help="model sizes (parameters) of the size sweep")
    ap.add_argument("--size-rate", type=float, default=0.03, help="change rate of the size sweep")
    ap.add_argument("--rate-size", type=float, default=64e6, help="model size (parameters) of the rate sweep")
    ap.add_argument("--rates", default="0.001,0.003,0.01,0.03,0.1,0.3,1.0", help="change rates of the rate sweep")
    ap.add_argument("--repeats", type=int, default=3,
                    help="refits per point of the rate sweep's model (the one with the median delta time is reported)")
    ap.add_argument("--size-repeats", type=int, default=1, help="refits per point of the other models")
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900, help="seconds any wait of a refit may take")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    # receiver mode (started by the trainer side)
    ap.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--transport", default="local", help=argparse.SUPPRESS)
    ap.add_argument("--params", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--id", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.receiver:
        return receiver_main(args)
    if args.resummarize:
        return resummarize(args)
    if args.smoke:
        args.sizes, args.rate_size, args.rates, args.timeout, args.repeats = "2e5,1e6", 1e6, "0.01,0.1,1.0", 120, 1
        if "--links" not in " ".join(argv):
            args.links = "local"
    args.mbit = max(ln["mbit"] for ln in parse_links(args.links))
    if args.mbit and not args.inside:
        return run_shaped(__file__, argv, args.mbit, log, NOT_ROOT)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
