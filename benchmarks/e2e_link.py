"""End-to-end refit over a shaped link, beside a full-checkpoint transfer over the same link.

    sudo python benchmarks/e2e_link.py                 # ~5 min: 1.07B params, 2 producers, 2 receivers
    python benchmarks/e2e_link.py --smoke --no-shape   # ~30 s: tiny model, unshaped loopback (CI smoke)

Set-up (root: it needs a network namespace): a private network namespace whose loopback
is shaped with `tc tbf` to --mbit (1000: 1 Gbit/s); everything below runs inside it, so
every byte between processes crosses the shaped link.
1. A random-init Qwen3-style BF16 checkpoint of --hidden/--layers (default 1.07B params,
   2.15 GB) is written as safetensors.
2. The link is measured (one TCP stream), and memcpy on one core between page-aligned
   buffers (benchmarks/memcpy.py), again after the refits: the bound takes the faster.
3. Reference, full checkpoint: one producer sends the checkpoint's bytes (4 MiB payloads)
   over the relay tree to --receivers stage-only receivers; timed until every receiver
   staged everything (transport only, as the paper's reference). The dense in-memory load
   of the same model through the receivers' loader (`load_state_dict`) is timed too.
   --dense-computed (slow links) takes the transfer as its bytes over the measured rate.
4. Delta refits: --producers torchrun ranks (benchmarks/e2e_producer.py) each hold a
   replica and own an even share; Hugging Face receivers (`nemo-dcr receive`) sit on the
   relay tree; after one unreported warm-up refit at 0.1% (kernel compilation, loader
   planning), --repeats refits per --rates entry (each a fresh perturbation), each
   verified against the trainer's state (verification timed separately); a rate reports
   its median refit (with that refit's breakdown) and the range. Payloads hold at most
   --payload-elements changes (2**21); with several sizes they take turns within each
   rate and each (rate, size) reports its own median.
Lower bound per refit: max(bytes that cross the link / link rate, bytes scanned /
(memcpy per core x cores)); every receiver's copy crosses the one shaped loopback, so the
link carries wire bytes x receivers (and the dense reference checkpoint x receivers).
Receivers, per rate (the issue's target 3): the pause (the slowest receiver's in-place
apply) over the full refit, the slowest receiver's stage + apply, and the apply beside the
dense load (a): pause / load time, and the model's bytes brought to the new version per
second of each. The dense load is timed alone and in one process per receiver at once
(started together: the receivers apply at the same time, and share the cores and memory).
Results: benchmarks/results/e2e_link.json and .png (--smoke: e2e_link_smoke.* in the temp dir; or --out).
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
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.outputs import results_path  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.memcpy import memcpy_gbs, touched_pair  # noqa: E402
from benchmarks.qwen3_shapes import qwen3_dims, qwen3_shapes  # noqa: E402
from benchmarks.shaped_link import measure_link, run_shaped  # noqa: E402
from tests.support.launch import free_port  # noqa: E402
NOT_ROOT = "e2e_link: shaping needs root (ip netns, tc); run with sudo, or --no-shape"


def log(msg: str) -> None:
    print(f"[e2e] {msg}", flush=True)


# --- outside the namespace ----------------------------------------------------------------

# --- inside -------------------------------------------------------------------------------

def write_checkpoint(path: Path, hidden: int, layers: int, vocab: int, seed: int = 0, weights: str = "random") -> int:
    """A BF16 Qwen3-style checkpoint, written tensor by tensor (no full model in RAM):
    random-init (N(0, 0.02), norms 1 + N(0, 0.05)), or with `weights` "minilm" every tensor
    a seeded resample of the pretrained MiniLM tensor of its role (benchmarks/real_deltas.py,
    `qwen3_sources`): statistics-matched to real weights."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    config = Qwen3Config(**qwen3_dims(hidden, layers, vocab), tie_word_embeddings=False,
                         max_position_embeddings=1024, torch_dtype="bfloat16")
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    shapes = qwen3_shapes(hidden, layers, vocab)
    params, shard, shard_bytes, index = 0, {}, 0, {}
    files = 0

    def flush():
        nonlocal shard, shard_bytes, files
        if shard:
            name = f"model-{files:05d}.safetensors"
            save_file(shard, path / name, metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, name))
            files += 1
            shard, shard_bytes = {}, 0

    minilm = None
    if weights == "minilm":
        from benchmarks.real_deltas import load_minilm, qwen3_sources

        minilm = {k: v.detach().reshape(-1) for k, v in load_minilm().state_dict().items()}
    for name, shape in shapes.items():
        if minilm is not None:
            src = minilm[qwen3_sources(name)]
            idx = torch.randint(0, src.numel(), shape, generator=g)
            t = src[idx].to(torch.bfloat16)
        elif len(shape) == 1:
            t = (1 + 0.05 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        else:
            t = (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        shard[name] = t
        shard_bytes += t.numel() * 2
        params += t.numel()
        if shard_bytes > 1 << 30:
            flush()
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": params * 2},
                                                                     "weight_map": index}))
    return params


def memcpy_one_core_gbs() -> float:
    """np.copyto of 256 MiB between page-aligned buffers, best of 5 (benchmarks/memcpy.py)."""
    return memcpy_gbs(*touched_pair(128 << 20), 5)[0]


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def relay_config(receivers: list[str]) -> dict:
    return {"nodes": [{"id": r, "endpoint": f"tcp://127.0.0.1:{free_port()}"} for r in receivers],
            "coordinator": f"tcp://127.0.0.1:{free_port()}", "fanout": 2, "timeout_s": 600,
            "max_in_flight_bytes": 256 << 20}


def start(cmd: list[str], logfile: Path, env: dict) -> subprocess.Popen:
    with open(logfile, "wb") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)


def wait_for(marker: str, logs: list[Path], procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        texts = [p.read_text(errors="replace") if p.exists() else "" for p in logs]
        if all(marker in t for t in texts):
            return
        for proc, text in zip(procs, texts):
            if proc.poll() is not None:
                raise RuntimeError(f"a process exited {proc.returncode}:\n{text[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"'{marker}' not seen within {timeout} s")
        time.sleep(0.2)


def dense_reference(ckpt: Path, receivers: list[str], work: Path, env: dict) -> float:
    """Seconds to deliver the checkpoint's bytes to every stage-only receiver over the tree."""
    from nemo_dcr import registry
    from nemo_dcr.records import TransferInfo

    config = relay_config(receivers)
    procs, logs = [], []
    for rx in receivers:
        logs.append(work / f"dense-{rx}.log")
        procs.append(start([sys.executable, "-m", "benchmarks.bench_receiver", "--transport", "relay",
                            "--config", json.dumps(config), "--id", rx], logs[-1], env))
    transport = registry.transport("relay", config, receivers=receivers)
    coord = transport.coordinator()
    prod = transport.producer("p0")
    try:
        time.sleep(2.0)  # the receivers bind their relays
        info = TransferInfo(uuid.uuid4().hex[:12], 0, 1, ("p0",))
        coord.broadcast("begin", {"transfer_id": info.transfer_id, "transfer": info.to_json()})
        coord.collect("ready", info.transfer_id, 120)
        ids = []
        t = time.perf_counter()
        for f in sorted(ckpt.glob("*.safetensors")):
            with open(f, "rb") as fh:
                while chunk := fh.read(4 << 20):
                    ids.append(f"p0-{len(ids):06d}")
                    prod.send(info, ids[-1], chunk)
        rejected = prod.flush(info, ids)
        seconds = time.perf_counter() - t
        if rejected:
            raise RuntimeError(f"dense reference rejected: {rejected}")
        coord.broadcast("shutdown", {})
    finally:
        prod.close()
        coord.close()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    return seconds


def dense_load_s(ckpt: Path, go: Path | None = None) -> float:
    """A dense in-memory load of the whole model through the receivers' loader
    (load_state_dict), best of 3. `go`: once model and state are in memory, print "ready"
    and wait for that file to exist before timing (`dense_loads_at_once`)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    state = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        state.update(load_file(f))
    model.load_state_dict(state, strict=False)  # the first load touches the weights' pages: untimed
    if go is not None:
        print("ready", flush=True)
        while not go.exists():
            time.sleep(0.005)
    return min(_timed(lambda: model.load_state_dict(state, strict=False)) for _ in range(3))


def dense_loads_at_once(ckpt: Path, n: int, work: Path, env: dict) -> float:
    """The same dense load in n processes at once, as n receivers would load a full refit
    side by side (the pause is their concurrent apply): the slowest process's best of 3."""
    go = work / "dense-load-go"
    go.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--dense-load-worker", str(ckpt), "--dense-load-go", str(go)]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a dense-load worker did not start (exit {p.wait()})")
        go.touch()
        seconds = []
        for p in procs:
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"a dense-load worker exited {p.returncode}")
            seconds.append(float(out.split()[-1]))
        return max(seconds)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        go.unlink(missing_ok=True)


def inside(args) -> int:
    import torch

    torch.set_num_threads(1)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="nemo-dcr-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    receivers = [f"rx{i}" for i in range(args.receivers)]
    rates = [float(r) for r in args.rates.split(",")]
    sizes = args.payload_sizes
    try:
        ckpt = work / "checkpoint"
        log(f"1/5 writing a {args.layers}-layer, hidden-{args.hidden} BF16 checkpoint to {ckpt}")
        params = write_checkpoint(ckpt, args.hidden, args.layers, args.vocab, weights=args.weights)
        dense_bytes = params * 2
        log(f"    {params / 1e9:.3f}B params, {dense_bytes / 1e9:.2f} GB")
        link_bps = measure_link(args.link_probe_mb << 20)
        mem_readings = [memcpy_one_core_gbs()]
        cores = os.cpu_count() or 1
        log(f"2/5 link {link_bps / 1e9:.3f} Gbit/s (one TCP stream); memcpy {mem_readings[0]:.2f} GB/s per core, "
            f"{cores} cores")
        log(f"3/5 full checkpoint to {len(receivers)} receivers over the relay tree (transport only)")
        if args.dense_computed:  # a slow link: the dense transfer would take longest of all
            dense_s = dense_bytes * len(receivers) * 8 / link_bps
        else:
            dense_s = dense_reference(ckpt, receivers, work, env)
        load_s = dense_load_s(ckpt)
        load_together_s = dense_loads_at_once(ckpt, len(receivers), work, env)
        log(f"    {dense_s:.1f} s transfer{' (computed from the link rate)' if args.dense_computed else ''}; dense load_state_dict {load_s:.2f} s alone, "
            f"{load_together_s:.2f} s in {len(receivers)} processes at once")
        log(f"4/5 {args.producers} producers, {len(receivers)} HF receivers, refits at {rates}")
        config = relay_config(receivers)
        procs, logs = [], []
        for rx in receivers:
            logs.append(work / f"{rx}.log")
            procs.append(start([sys.executable, "-m", "nemo_dcr.cli", "receive", "--checkpoint", str(ckpt),
                                "--transport", "relay", "--transport-config", json.dumps(config), "--id", rx]
                               + (["--no-state-digest"] if args.no_state_digest else []), logs[-1], env))
        wait_for("serving version 0", logs, procs, 900)
        rows_path = work / "rows.jsonl"
        rows_path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.producers),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               str(REPO / "benchmarks" / "e2e_producer.py"), "--checkpoint", str(ckpt),
               "--transport-config", json.dumps(config), "--state-dir", str(work / "state"),
               "--rates", ",".join(str(r) for r in rates for _ in range(args.repeats)), "--results", str(rows_path),
               "--op", args.op, "--payload-elements", ",".join(map(str, sizes)), "--changes", args.changes]
        cmd += ["--conditioned"] if args.conditioned else []
        cmd += ["--no-state-digest"] if args.no_state_digest else []
        shutil.rmtree(work / "state", ignore_errors=True)
        rc = subprocess.call(cmd, cwd=REPO, env=env)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        if rc != 0:
            raise RuntimeError(f"producers exited {rc}; receiver logs in {work}")
        rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
        rows = [_median_refit([r for r in rows if not r.get("warmup") and r["rate"] == rate
                               and r["payload_elements"] == size]) for rate in rates for size in sizes]
        mem_readings.append(memcpy_one_core_gbs())  # the processes above have exited: the copy has the machine
        mem = max(mem_readings)
        log(f"5/5 results (memcpy {mem_readings[1]:.2f} GB/s per core now, {mem_readings[0]:.2f} at the start: "
            f"the bound takes {mem:.2f})")
        full_refit_s = dense_s + load_s
        out_rows = []
        for r in rows:
            link_bytes = r["wire_bytes"] * len(receivers)
            bound = max(link_bytes * 8 / link_bps, dense_bytes / (mem * 1e9 * cores))
            row = {
                "rate": r["rate"], "payload_elements": r["payload_elements"], "bit_exact": r["bit_exact"],
                "refit_s": r["refit_s"], "wire_bytes": r["wire_bytes"], "payloads": r["payloads"],
                "changed_elements": r["changed_elements"], "lower_bound_s": bound,
                "refit_over_bound": r["refit_s"] / bound, "speedup_vs_dense_transfer": dense_s / r["refit_s"],
                "pause_s": r["pause_s"], "receiver_stage_s": r["receiver_stage_s"],
                "pause_over_full_refit": r["pause_s"] / full_refit_s, "verify_s": r["verify_s"],
                # the receivers' side beside (a) the dense in-memory load: the slowest receiver's
                # staging (decoding while the transfer runs) plus its apply, and the apply as the
                # model's bytes brought to the new version per second of pause (the loads' rate:
                # dense_bytes / dense_load_s, / dense_loads_at_once_s)
                "receiver_total_s": r["receiver_stage_s"] + r["pause_s"],
                "pause_over_dense_load": r["pause_s"] / load_s,
                "pause_over_dense_loads_at_once": r["pause_s"] / load_together_s,
                "apply_model_gbs": dense_bytes / r["pause_s"] / 1e9,
                "apply_changes_per_s": r["changed_elements"] / r["pause_s"],
                "refits_s": r["refits_s"], "all_bit_exact": r["all_bit_exact"],
                "producer": {k: v for k, v in r.items() if k.startswith("producer_")},
                # where the refit's time goes: the coordinator's phases (begin, waiting for
                # every receiver's applied reply, commit) and the receivers' own times
                "coordinator": {k: v for k, v in r.items() if k.startswith("coordinator_")},
                "receiver": {k: v for k, v in r.items() if k.startswith("receiver_")},
            }
            out_rows.append(row)
            each = sorted(round(x, 2) for x in r["refits_s"])
            which = f", payloads of up to {r['payload_elements']:,} changes" if len(sizes) > 1 else ""
            log(f"    {r['rate']:.0%}{which}: refit {r['refit_s']:.2f} s (median of {each}) vs dense "
                f"{dense_s:.1f} s -> {dense_s / r['refit_s']:.1f}x; lower bound {bound:.2f} s "
                f"({r['refit_s'] / bound:.2f}x of it); "
                f"pause {r['pause_s']:.2f} s ({row['pause_over_full_refit']:.3f} of a full refit, "
                f"{row['pause_over_dense_load']:.2f}x a dense load alone, {row['pause_over_dense_loads_at_once']:.2f}x "
                f"{len(receivers)} at once); receivers' stage + apply {row['receiver_total_s']:.2f} s; "
                f"bit-exact {r['bit_exact']}; verify {r['verify_s']:.1f} s")
        result = {"benchmark": "e2e_link", "smoke": args.smoke, "shaped": not args.no_shape, "mbit": args.mbit,
                  "op": args.op, "payload_elements": sizes, "weights": args.weights, "changes": args.changes,
                  "conditioned": args.conditioned, "state_digest": not args.no_state_digest,
                  "params": params, "dense_bytes": dense_bytes, "producers": args.producers,
                  "receivers": len(receivers), "link_gbps_measured": link_bps / 1e9, "memcpy_gbs_per_core": mem,
                  "memcpy_gbs_readings": mem_readings,
                  "cores": cores, "dense_transfer_s": dense_s, "dense_transfer_measured": not args.dense_computed,
                  "dense_load_s": load_s,
                  "dense_loads_at_once_s": load_together_s,
                  "full_refit_s": full_refit_s, "rows": out_rows,
                  "machine": machine_info()}
        path = results_path("e2e_link", args.out, args.smoke)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        plot(result, path.with_suffix(".png"))
        log(f"wrote {path} and {path.with_suffix('.png')}")
        return 0 if all(r["all_bit_exact"] for r in out_rows) else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _median_refit(rows: list[dict]) -> dict:
    """The median refit of one rate's rows (the lower middle one for an even count), with
    every refit's time and whether all were bit-exact."""
    chosen = sorted(rows, key=lambda r: r["refit_s"])[(len(rows) - 1) // 2]
    return {**chosen, "refits_s": [r["refit_s"] for r in rows], "all_bit_exact": all(r["bit_exact"] for r in rows)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    several = len(result["payload_elements"]) > 1
    labels = ["full checkpoint"] + [f"delta {r['rate']:.0%}" + (f"\n{r['payload_elements']:,}" if several else "")
                                    for r in rows]
    values = [result["dense_transfer_s"]] + [r["refit_s"] for r in rows]
    bounds = [None] + [r["lower_bound_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, values, color=["#999"] + ["#4a7"] * len(rows))
    for i, b in enumerate(bounds):
        if b:
            ax.plot([i - 0.4, i + 0.4], [b, b], "k--", lw=1)
    ax.set_ylabel("seconds")
    ax.set_yscale("log")
    ax.set_title(f"{result['params'] / 1e9:.2f}B params, {result['receivers']} receivers, "
                 f"{result['link_gbps_measured']:.2f} Gbit/s link (dashed: lower bound)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--rates", default="0.03,0.05")
    ap.add_argument("--repeats", type=int, default=3, help="refits per rate; the median is reported")
    ap.add_argument("--op", default="auto", choices=["auto", "xor", "add"],
                    help="the producers' op (TrainerRefit's default: auto, xor or add per tensor)")
    ap.add_argument("--payload-elements", default=str(1 << 21),
                    help="the producers' max_payload_elements (changes a payload holds at most); several, "
                         "comma-separated, take turns within each rate and are reported side by side")
    ap.add_argument("--weights", default="random", choices=["random", "minilm"],
                    help="random-init, or resampled from pretrained MiniLM per role (statistics-matched)")
    ap.add_argument("--changes", default="ulp", choices=["ulp", "adamw"],
                    help="±1 ULP at uniformly random elements, or AdamW-like steps (e2e_producer.perturb_adamw)")
    ap.add_argument("--conditioned", action="store_true",
                    help="the producers code records against the committed bits (wire/conditioned.py)")
    ap.add_argument("--mbit", type=int, default=1000)
    ap.add_argument("--link-probe-mb", type=int, default=200)
    ap.add_argument("--dense-computed", action="store_true",
                    help="take the dense transfer as its bytes over the measured link rate instead of sending "
                         "them (for slow links, where sending them would take longest of all)")
    ap.add_argument("--no-shape", action="store_true", help="run on the plain loopback (no namespace, no root)")
    ap.add_argument("--no-state-digest", action="store_true",
                    help="producers and receivers keep no whole-state digest (the cost of the proof, by difference)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, seconds")
    ap.add_argument("--workdir")
    ap.add_argument("--out", help="results JSON (default benchmarks/results/e2e_link.json; with --smoke, "
                                  "the temp dir); the PNG beside it")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dense-load-worker", help=argparse.SUPPRESS)  # a process of dense_loads_at_once
    ap.add_argument("--dense-load-go", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.payload_elements.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        ap.error("--payload-elements must be distinct positive integers, comma-separated; "
                 f"got {args.payload_elements!r}")
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.link_probe_mb, args.repeats = 128, 2, 512, 8, len(sizes)
    if args.repeats < len(sizes):
        ap.error(f"--repeats must be at least 1 per payload size ({len(sizes)}), got {args.repeats}")
    args.payload_sizes = sizes
    if args.dense_load_worker:
        print(f"{dense_load_s(Path(args.dense_load_worker), Path(args.dense_load_go)):.6f}", flush=True)
        return 0
    if args.inside or args.no_shape:
        return inside(args)
    return run_shaped(__file__, argv, args.mbit, log, NOT_ROOT)


if __name__ == "__main__":
    sys.exit(main())
