"""Soak: many consecutive refits into several receiver processes; nothing may grow.

    python benchmarks/soak.py                                   # 10 warm-up + 50 refits, 4 receivers, local
    python benchmarks/soak.py --transport relay --refits 50 --receivers 4 --out /tmp/soak-relay.json
    python benchmarks/soak.py --transport s3                    # starts a local S3 server (moto)
    python benchmarks/soak.py --smoke                           # seconds: small model, a few refits (CI)

Set-up: a random-init Llama-style BF16 checkpoint (--hidden, --layers, --vocab) is
version 0. Receivers are separate processes, each the real `nemo-dcr receive` code path
(the CLI's own parser and `cmd_receive`: a Hugging Face model refitted in place) plus one
idle thread that answers this script's requests for in-process figures. The trainer runs
here: the same model under AdamW, `TrainerRefit` on a one-process gloo group, identity
placement, with a file-backed (journaled) baseline unless --no-durable-baseline.

Each refit: one AdamW step, `refit()` (must commit), then verification (timed apart from
the refit): the trainer's per-tensor BLAKE2b digests against every receiver's (through
`Coordinator.verify`), and the serving version. After the last refit every receiver's
full state is also compared element by element (`verify.bit_mismatches`).

After every refit each process is sampled (the first --warmup refits are warm-up: kernel
compilation, loader planning, lazily opened sockets and pools). From /proc: resident
memory (VmRSS, and RssAnon), open fds, sockets and regular files among them, shared-memory
mappings (/dev/shm in maps or fds), threads. In process (the trainer here; each receiver
through its stats thread): the gc object count after gc.collect(), Python's allocated
blocks (`sys.getallocatedblocks()`, which also sees untracked objects: strings, numbers,
bytes), the threads that are ThreadPoolExecutor workers, and glibc's heap (`mallinfo2`,
all arenas): bytes in use, and bytes free inside the arenas. Per transport: segments left
in the local transport's directory, objects under the S3 prefix (commit records counted
apart: one per version, by design), files in the trainer's state and baseline directories.

Checks (post-warm-up; exit code 1 when one fails):
- resident memory (VmRSS): the median and the minimum of the last fifth of the samples may
  not exceed those of the first fifth by more than max(--rss-tol-pct % of the first sample,
  --rss-tol-mib MiB); the raw last - first and the least-squares slope are reported beside
  them (glibc trims or keeps the top of a heap after large transient allocations, which
  moves a process's RSS by tens of MiB either way from one sample to the next);
- heap in use: last - first and the fitted growth within max(--heap-tol-pct %, --heap-tol-mib MiB);
- counts (fds, sockets, files, shm, threads other than executor workers, shm segments, S3
  objects): the minimum of the last fifth may not exceed that of the first fifth (a leaked
  handle stays and raises it; a transient one, e.g. an S3 receiver's connection caught
  mid-poll, shows in max and the median, which are reported);
- executor workers: no growth over the second half of the run (pools start them lazily,
  up to their cap);
- gc objects and Python blocks may fluctuate, but last - first and the fitted growth must
  stay within max(0.1 %, 100);
- every refit and the final state bit-exact;
- after shutdown: every receiver exited 0; the trainer holds no more fds, sockets, files or
  shared memory than before the refit machinery was set up, and no thread that was not
  running then (pyzmq's zero-copy garbage collector, a process-wide singleton, aside); the
  transport left no payload behind before its `cleanup()`, and nothing after it.

Results: benchmarks/results/soak[-<transport>].json (every sample, every check) and .png
(RSS per process vs refit). --malloc-mmap-threshold fixes glibc's mmap threshold in every
process (a diagnostic: it tells allocator fragmentation from live memory).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import ctypes
import gc
import json
import math
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.outputs import results_path  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402

COUNTS = ("fds", "sockets", "files", "shm", "threads")
HEAP = ("gc_objects", "py_blocks", "pool_threads", "heap_in_use_mib", "heap_free_mib")


def log(msg: str) -> None:
    print(f"[soak] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="",
               PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return env


# --- /proc sampling ----------------------------------------------------------------------

def proc_sample(pid: int, detail: bool = False) -> dict:
    """Resident memory and handle counts of one process, from /proc (with `detail`, also
    the shared-memory paths it maps or holds open)."""
    status = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            status[k] = v.strip()
    kib = lambda k: int(status.get(k, "0 kB").split()[0])  # noqa: E731
    fds = sockets = files = 0
    shm = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:  # closed meanwhile
            continue
        fds += 1
        if target.startswith("socket:"):
            sockets += 1
        elif target.startswith("/dev/shm/"):
            shm.add(target)
        elif target.startswith("/") and not target.startswith(("/dev/", "/proc/")):
            files += 1
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            i = line.find("/dev/shm/")
            if i >= 0:
                shm.add(line[i:].strip())
    out = {"rss_mib": kib("VmRSS") / 1024, "rss_anon_mib": kib("RssAnon") / 1024, "fds": fds,
           "sockets": sockets, "files": files, "shm": len(shm), "threads": len(os.listdir(f"/proc/{pid}/task"))}
    if detail:
        out["shm_paths"] = sorted(shm)
        names = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/comm") as f:
                names.append(f.read().strip())
        out["thread_names"] = sorted(names)
    return out


def gc_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_stats() -> dict:
    """In-process: the gc object count (after gc.collect()), Python's allocated blocks, the
    threads that are ThreadPoolExecutor workers (pools start them lazily, up to a cap), and
    glibc's heap (mallinfo2, all arenas): bytes in use (a leak shows here) and bytes free
    inside the arenas (fragmentation: resident, but reusable)."""
    from concurrent.futures.thread import _worker

    pool = sum(1 for t in threading.enumerate() if getattr(t, "_target", None) is _worker)
    out = {"gc_objects": gc_objects(), "py_blocks": sys.getallocatedblocks(), "pool_threads": pool,
           "heap_in_use_mib": math.nan, "heap_free_mib": math.nan}
    try:
        f = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):  # not glibc >= 2.33
        return out
    f.restype = _MallInfo2
    m = f()
    out.update(heap_in_use_mib=(m.uordblks + m.hblkhd) / 2**20, heap_free_mib=m.fordblks / 2**20)
    return out


def new_threads(before: dict, after: dict) -> list[str]:
    """Threads running after close that did not before set-up (OS thread names and Python
    thread names, as multisets), less pyzmq's zero-copy garbage collector: a process-wide
    singleton (a Python thread with a zmq context of its own: three OS threads) that the first
    `send(copy=False)` starts and that lives until the process exits."""
    def minus(a: list[str], b: list[str]) -> list[str]:
        left = list(a)
        for x in b:
            if x in left:
                left.remove(x)
        return left

    os_new = minus(after["thread_names"], before["thread_names"])
    py_new = minus(after.get("python_threads", []), before.get("python_threads", []))
    with contextlib.suppress(ImportError):
        import zmq.utils.garbage

        collector = zmq.utils.garbage.gc
        if collector.is_alive():
            os_new = minus(os_new, ["ZMQbg/IO/0", "ZMQbg/Reaper", "python"])
            py_new = minus(py_new, [collector.thread.name])
    return sorted(os_new) + [f"python thread {n!r}" for n in sorted(py_new)]


def count_files(folder: Path, skip: tuple[str, ...] = ()) -> int:
    """Files and directories under `folder` (recursively), not counting top-level `skip` entries."""
    if not folder.exists():
        return 0
    n = 0
    for root, dirs, names in os.walk(folder):
        if Path(root) == folder:
            dirs[:] = [d for d in dirs if d not in skip]
            names = [x for x in names if x not in skip]
        n += len(dirs) + len(names)
    return n


# --- the receiver process -------------------------------------------------------------------

def receiver_main(args) -> int:
    """`nemo-dcr receive` (the CLI's own parser and code path) in the main thread; a stats
    thread answers each line on stdin with the process's heap figures on the --stats-fd pipe."""
    from nemo_dcr.cli import main as cli_main

    out = os.fdopen(args.stats_fd, "w", buffering=1)

    def stats():
        for line in sys.stdin:
            out.write(json.dumps({"seq": line.strip(), **heap_stats()}) + "\n")

    threading.Thread(target=stats, daemon=True, name="soak-stats").start()
    return cli_main(["receive", "--checkpoint", args.checkpoint, "--id", args.id, "--transport", args.transport,
                     "--transport-config", args.transport_config])


class ReceiverProc:
    def __init__(self, rx: str, checkpoint: Path, transport: str, config: dict, workdir: Path):
        self.id = rx
        self.log_path = workdir / f"{rx}.log"
        r, w = os.pipe()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--as-receiver", "--id", rx,
               "--checkpoint", str(checkpoint), "--transport", transport,
               "--transport-config", json.dumps(config), "--stats-fd", str(w)]
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdin=subprocess.PIPE, stdout=logf,
                                         stderr=subprocess.STDOUT, pass_fds=(w,), start_new_session=True,
                                         text=True)
        os.close(w)
        self.stats_r = os.fdopen(r, "r")
        self.seq = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def heap_stats(self, timeout: float = 60.0) -> dict:
        self.seq += 1
        self.proc.stdin.write(f"{self.seq}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.stats_r], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                raise RuntimeError(f"{self.id}: no stats reply within {timeout} s")
            reply = json.loads(self.stats_r.readline())
            if reply.pop("seq") == str(self.seq):
                return reply

    def close_stats(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        self.stats_r.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait()


def wait_ready(rxs: list[ReceiverProc], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    waiting = {r.id: r for r in rxs}
    while waiting:
        for rid, r in list(waiting.items()):
            if "serving version 0" in r.log():
                del waiting[rid]
            elif r.proc.poll() is not None:
                raise RuntimeError(f"receiver {rid} exited {r.proc.returncode}:\n{r.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"receivers {sorted(waiting)} not ready within {timeout} s")
        time.sleep(0.1)


# --- transports ----------------------------------------------------------------------------

@contextlib.contextmanager
def transport_setup(name: str, receivers: list[str], workdir: Path):
    """(config, extra) for one transport, with whatever server it needs started here."""
    if name == "local":
        shm = Path(f"/dev/shm/nemo-dcr-soak-{os.getpid()}")
        try:
            yield {"dir": str(shm), "timeout_s": 60}, {"shm_dir": shm}
        finally:
            shutil.rmtree(shm, ignore_errors=True)
    elif name == "relay":
        yield {"nodes": [{"id": r, "endpoint": f"tcp://127.0.0.1:{free_port()}"} for r in receivers],
               "coordinator": f"tcp://127.0.0.1:{free_port()}", "fanout": 2, "timeout_s": 60}, {}
    elif name == "s3":
        from tests.support.s3_server import moto_server

        with moto_server() as server:
            config = server.config(server.new_bucket(), prefix=f"soak-{os.getpid()}", timeout_s=60)
            yield config, {"server_pid": server.process.pid}
    else:
        raise SystemExit(f"no soak set-up for transport {name!r}; use local, relay or s3")


def s3_counts(client, transport) -> dict:
    """Objects under the transport's prefix: commit records, receiver presence, and the rest."""
    counts = {"s3_commit_records": 0, "s3_presence": 0, "s3_other": 0}
    kw = {}
    while True:
        r = client.list_objects_v2(Bucket=transport.bucket, Prefix=transport.prefix + "/", **kw)
        for o in r.get("Contents", ()):
            rel = o["Key"][len(transport.prefix) + 1:]
            kind = rel.split("/", 1)[0]
            counts["s3_commit_records" if kind == "commits" else "s3_presence" if kind == "receivers"
                   else "s3_other"] += 1
        if not r.get("IsTruncated"):
            return counts
        kw = {"ContinuationToken": r["NextContinuationToken"]}


# --- statistics ------------------------------------------------------------------------------

def slope(values: list[float]) -> float:
    """Least-squares slope per refit."""
    n = len(values)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(values) / n
    sxx = sum((i - mx) ** 2 for i in range(n))
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sxx


def check(process: str, metric: str, values: list[float], kind: str, args) -> dict:
    first, last, top = values[0], values[-1], max(values)
    s = slope(values)
    fitted = s * (len(values) - 1)
    k = max(3, len(values) // 5)
    head, tail = sorted(values[:k]), sorted(values[-k:])
    window = tail[len(tail) // 2] - head[len(head) // 2]  # median of the last k minus median of the first k
    floor = tail[0] - head[0]
    row = {"process": process, "metric": metric, "first": first, "last": last, "max": top, "slope": s,
           "growth": last - first, "fitted_growth": fitted, "window_growth": window, "floor_growth": floor}
    if kind == "rss":
        # Resident memory jumps by tens of MiB both ways when glibc trims (or not) the top of a heap
        # after large transient allocations (the trainer's activations): judged on the medians and
        # the floors of the first and last fifths, which a leak raises and that noise does not.
        limit = max(first * args.rss_tol_pct / 100, args.rss_tol_mib)
        row.update(limit=limit, rule=f"median and floor growth, first vs last fifth, <= {limit:.1f} MiB",
                   passed=window <= limit and floor <= limit)
    elif kind == "heap":
        limit = max(first * args.heap_tol_pct / 100, args.heap_tol_mib)
        row.update(limit=limit, rule=f"growth and fitted growth <= {limit:.1f} MiB",
                   passed=last - first <= limit and fitted <= limit)
    elif kind == "gc":
        limit = max(first * 0.001, 100)
        row.update(limit=limit, rule=f"growth and fitted growth <= {limit:.0f}",
                   passed=last - first <= limit and fitted <= limit)
    elif kind == "count":
        # A leaked handle stays: it raises the floor (minimum) of the last fifth. A transient one
        # (an S3 receiver's connection caught mid-poll) does not; it shows in max and the median.
        row.update(limit=0, rule="minimum of the last fifth <= minimum of the first", passed=floor <= 0)
    elif kind == "pool":  # lazy growth up to a cap is fine; growth that goes on to the end is not
        half = values[len(values) // 2:]
        row.update(limit=0, rule="no growth over the second half", passed=max(half) <= half[0])
    elif kind == "by-design":  # one commit record per version: must grow by exactly one per refit
        row.update(limit=None, rule="exactly +1 per refit", passed=all(b - a == 1 for a, b in zip(values, values[1:])))
    else:
        row.update(limit=None, rule="reported only", passed=True)
    return row


# --- the soak ----------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description="soak: many refits, flat memory, nothing leaked")
    p.add_argument("--refits", type=int, default=None, help="refits sampled after the warm-up (default 50)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up refits, not checked (default 10)")
    p.add_argument("--receivers", type=int, default=4)
    p.add_argument("--transport", default="local", choices=["local", "relay", "s3"])
    p.add_argument("--hidden", type=int, default=None, help="default 256 (64 with --smoke)")
    p.add_argument("--layers", type=int, default=None, help="default 4 (2 with --smoke)")
    p.add_argument("--vocab", type=int, default=None, help="default 8000 (512 with --smoke)")
    p.add_argument("--lr", type=float, default=3e-5, help="AdamW learning rate (sets the change rate)")
    p.add_argument("--max-payload-elements", type=int, default=1 << 16)
    p.add_argument("--no-durable-baseline", action="store_true", help="keep the trainer's baseline in RAM only")
    p.add_argument("--rss-tol-pct", type=float, default=2.0)
    p.add_argument("--rss-tol-mib", type=float, default=4.0)
    p.add_argument("--heap-tol-pct", type=float, default=1.0)
    p.add_argument("--heap-tol-mib", type=float, default=2.0)
    p.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="diagnostic: fix glibc's mmap threshold (M_MMAP_THRESHOLD) in every process, so "
                        "freed large buffers go back to the OS instead of staying in the heap")
    p.add_argument("--smoke", action="store_true", help="a few refits of a small model (CI)")
    p.add_argument("--out", help="results JSON (default benchmarks/results/soak[-TRANSPORT].json); PNG beside it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--as-receiver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--id", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--transport-config", help=argparse.SUPPRESS)
    p.add_argument("--stats-fd", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.as_receiver:
        return receiver_main(args)
    smoke = args.smoke
    args.refits = args.refits if args.refits is not None else (4 if smoke else 50)
    args.warmup = args.warmup if args.warmup is not None else (3 if smoke else 10)
    args.hidden = args.hidden or (64 if smoke else 256)
    args.layers = args.layers or (2 if smoke else 4)
    args.vocab = args.vocab or (512 if smoke else 8000)
    if args.refits < 2 or args.receivers < 1 or args.warmup < 1:
        raise SystemExit("need --refits >= 2, --warmup >= 1 and --receivers >= 1")
    if args.malloc_mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)  # the receivers' glibc reads it
        if ctypes.CDLL(None).mallopt(-3, args.malloc_mmap_threshold) != 1:  # M_MMAP_THRESHOLD, this process
            raise SystemExit("mallopt(M_MMAP_THRESHOLD) failed")
    out = results_path("soak" if args.transport == "local" else f"soak-{args.transport}", args.out, smoke)
    workdir = Path(tempfile.mkdtemp(prefix="nemo-dcr-soak-"))
    try:
        return run(args, out, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(args, out: Path, workdir: Path) -> int:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from nemo_dcr import registry
    from nemo_dcr.capture import torch_owned_ranges
    from nemo_dcr.checkpoint import read_specs
    from nemo_dcr.cli import make_checkpoint
    from nemo_dcr.layout import ParallelLayout
    from nemo_dcr.trainer import TrainerRefit
    from nemo_dcr.verify import bit_mismatches, compare_digests, state_digests

    ids = [f"rx{i}" for i in range(args.receivers)]
    total = args.warmup + args.refits
    ckpt = workdir / "checkpoint-v0"
    t = time.perf_counter()
    heads = max(args.hidden // 32, 2)
    make_checkpoint(ckpt, family="llama", hidden=args.hidden, layers=args.layers, heads=heads,
                    kv_heads=max(heads // 2, 1), ffn=3 * args.hidden, vocab=args.vocab, seed=args.seed)
    specs = read_specs(ckpt)
    dense = sum(math.prod(shape) * 2 for _, shape in specs.values())
    log(f"{args.transport}: {total} refits ({args.warmup} warm-up) into {args.receivers} receiver processes; "
        f"model {args.hidden}x{args.layers} layers, vocab {args.vocab}: {dense / 2 / 1e6:.1f}M params, "
        f"{dense / 1e6:.1f} MB BF16 (checkpoint in {time.perf_counter() - t:.1f} s)")

    with contextlib.ExitStack() as stack:
        config, extra = stack.enter_context(transport_setup(args.transport, ids, workdir))
        rxs: list[ReceiverProc] = []
        stack.callback(lambda: [r.kill() for r in rxs])
        t = time.perf_counter()
        for rx in ids:
            rxs.append(ReceiverProc(rx, ckpt, args.transport, config, workdir))
        wait_ready(rxs)
        log(f"receivers ready in {time.perf_counter() - t:.1f} s (pids {[r.pid for r in rxs]})")

        dist.init_process_group("gloo", init_method=f"file://{workdir / 'pg-store'}", rank=0, world_size=1)
        stack.callback(lambda: dist.is_initialized() and dist.destroy_process_group())
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        transport = registry.transport(args.transport, config, receivers=ids)
        s3 = transport.client() if args.transport == "s3" else None
        gen = torch.Generator().manual_seed(args.seed)
        state_dir, baseline_dir = workdir / "state", workdir / "baseline"

        def step():
            batch = torch.randint(0, args.vocab, (4, 64), generator=gen)
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        # One forward/backward without a step (the weights stay version 0's) starts torch's
        # thread pools before the reference sample; the refit machinery is not set up yet.
        batch = torch.randint(0, args.vocab, (4, 64), generator=torch.Generator().manual_seed(args.seed + 1))
        model(input_ids=batch, labels=batch).loss.backward()
        opt.zero_grad(set_to_none=True)
        del batch
        gc_objects()
        before = proc_sample(os.getpid(), detail=True)
        before["python_threads"] = sorted(t.name for t in threading.enumerate())
        refit = TrainerRefit(registry.converter("identity", model.config), specs, torch_owned_ranges(model),
                             ParallelLayout(), transport, state_dir=str(state_dir),
                             baseline_dir=None if args.no_durable_baseline else str(baseline_dir),
                             max_payload_elements=args.max_payload_elements, timeout_s=60)
        live = {"refit": refit, "s3": s3}  # closed here on failure; the normal path closes them below
        stack.callback(lambda: [x.close() for x in live.values() if x is not None])

        procs = {"trainer": os.getpid(), **{r.id: r.pid for r in rxs}}
        metrics = ("rss_mib", "rss_anon_mib", *COUNTS, *HEAP, "other_threads")
        # Preallocated C doubles, so this script's own bookkeeping allocates nothing per refit.
        new = lambda: array.array("d", [math.nan]) * total  # noqa: E731
        series = {name: {m: new() for m in metrics} for name in procs}
        transport_metrics = ["state_files", "commit_records", "baseline_files"]
        if args.transport == "local":
            transport_metrics += ["shm_segments", "shm_dir_entries"]
        if args.transport == "s3":
            transport_metrics += ["s3_other", "s3_presence", "s3_commit_records"]
            series["s3-server"] = {m: new() for m in ("rss_mib", "rss_anon_mib", *COUNTS)}
        series["transport"] = {m: new() for m in transport_metrics}
        per_refit = {k: new() for k in ("version", "change_rate", "changed_elements", "wire_bytes",
                                                     "payloads", "refit_s", "pause_s", "verify_s", "bit_exact")}

        for i in range(total):
            step()
            result = refit.refit()
            m = result.metrics()
            # Verification, timed apart: trainer digests vs every receiver's, and the serving version.
            t = time.perf_counter()
            expected = state_digests(model.state_dict())
            replies = refit.coordinator.verify()
            bad = {rx: compare_digests(expected, r.get("digests", {})) for rx, r in replies.items()}
            exact = (len(replies) == len(ids) and all(not v for v in bad.values())
                     and all(r.get("version") == m["version"] for r in replies.values()))
            verify_s = time.perf_counter() - t
            for k, v in (("version", m["version"]), ("change_rate", m["change_rate"]),
                         ("changed_elements", m["changed_elements"]), ("wire_bytes", m["wire_bytes"]),
                         ("payloads", m["payloads"]), ("refit_s", m["refit_s"]), ("pause_s", m["pause_s"]),
                         ("verify_s", verify_s), ("bit_exact", float(exact))):
                per_refit[k][i] = v
            if not exact:
                log(f"refit {i + 1}: NOT bit-exact: {[(rx, v[:3]) for rx, v in bad.items() if v]}")
                return 1
            del result, m, expected, replies, bad
            # Samples: in-process object counts first (the stats thread's pipe traffic is then over).
            for k, v in heap_stats().items():
                series["trainer"][k][i] = v
            for r in rxs:
                for k, v in r.heap_stats().items():
                    series[r.id][k][i] = v
            for name, pid in procs.items():
                for k, v in proc_sample(pid).items():
                    series[name][k][i] = v
                series[name]["other_threads"][i] = series[name]["threads"][i] - series[name]["pool_threads"][i]
            if "server_pid" in extra:
                for k, v in proc_sample(extra["server_pid"]).items():
                    series["s3-server"][k][i] = v
            tm = series["transport"]
            tm["state_files"][i] = count_files(state_dir, skip=("commits",))
            tm["commit_records"][i] = count_files(state_dir / "commits")
            tm["baseline_files"][i] = count_files(baseline_dir)
            if args.transport == "local":
                tm["shm_segments"][i] = count_files(extra["shm_dir"] / "data")
                tm["shm_dir_entries"][i] = count_files(extra["shm_dir"])
            if s3 is not None:
                for k, v in s3_counts(s3, transport).items():
                    tm[k][i] = v
            tr = series["trainer"]
            rx_rss = "/".join(f"{series[r.id]['rss_mib'][i]:.0f}" for r in rxs)
            rx_fds = "/".join(f"{series[r.id]['fds'][i]:.0f}" for r in rxs)
            extra_note = (f" segs {tm['shm_segments'][i]:.0f}" if args.transport == "local"
                          else f" objs {tm['s3_other'][i]:.0f}" if s3 is not None else "")
            log(f"refit {i + 1:3d}/{total}{' (warm-up)' if i < args.warmup else ''} v{per_refit['version'][i]:.0f} "
                f"change {100 * per_refit['change_rate'][i]:.2f}% wire {per_refit['wire_bytes'][i] / 1e6:.2f} MB "
                f"refit {per_refit['refit_s'][i]:.2f} s verify {verify_s:.2f} s exact | "
                f"RSS MiB trainer {tr['rss_mib'][i]:.1f} rx {rx_rss} | fds {tr['fds'][i]:.0f} rx {rx_fds} "
                f"sockets {tr['sockets'][i]:.0f} threads {tr['threads'][i]:.0f} gc {tr['gc_objects'][i]:.0f}"
                f"{extra_note}")

        # What the shared-memory counts above are made of (after the last refit).
        shm_paths = {name: proc_sample(pid, detail=True)["shm_paths"] for name, pid in procs.items()}
        log(f"shared memory mapped or open after the last refit: {shm_paths}")

        # Element-by-element end state: every receiver's full bits against the trainer's.
        dump = workdir / "dump"
        dump.mkdir()
        t = time.perf_counter()
        replies = refit.coordinator.verify(dump_dir=str(dump))
        from safetensors.torch import load_file

        want = {k: v.detach().clone() for k, v in model.state_dict().items()}
        final_bad = {rx: bit_mismatches(want, load_file(dump / f"{rx}.safetensors")) for rx in ids}
        final_exact = all(not v for v in final_bad.values()) and len(replies) == len(ids)
        final_s = time.perf_counter() - t
        del want, replies
        shutil.rmtree(dump)
        log(f"final element-by-element comparison of {len(ids)} receivers: "
            f"{'identical' if final_exact else final_bad} ({final_s:.1f} s)")

        # Shutdown: receivers must exit 0; the trainer must be back to its pre-set-up handles.
        for r in rxs:
            r.close_stats()
        live.clear()
        refit.close(shutdown_receivers=True)
        codes = {}
        for r in rxs:
            try:
                codes[r.id] = r.proc.wait(60)
            except subprocess.TimeoutExpired:
                codes[r.id] = None
        leftovers = {"shm_paths_after_last_refit": shm_paths}
        if args.transport == "local":
            shm = extra["shm_dir"]
            left = sorted(str(Path(root, x).relative_to(shm)) for root, dirs, names in os.walk(shm) for x in names)
            # Payload segments must all be gone; the ipc socket files stay until cleanup() (libzmq does
            # not unlink a bound ipc endpoint on close): one per endpoint, reused, so bounded.
            leftovers["local_segments_before_cleanup"] = [x for x in left if not x.startswith("sock/")]
            leftovers["local_ipc_files_before_cleanup"] = [x for x in left if x.startswith("sock/")]
        if s3 is not None:
            leftovers["s3_before_cleanup"] = s3_counts(s3, transport)
        transport.cleanup()
        if args.transport == "local":
            leftovers["local_dir_exists_after_cleanup"] = extra["shm_dir"].exists()
        if s3 is not None:
            leftovers["s3_after_cleanup"] = s3_counts(s3, transport)
            s3.close()
        del refit, transport, s3
        for r in rxs:
            r.kill()  # any that did not exit (their codes above say so)
        dist.destroy_process_group()
        gc_objects()
        after = proc_sample(os.getpid(), detail=True)
        after["python_threads"] = sorted(t.name for t in threading.enumerate())
        after["new_threads"] = new_threads(before, after)
    # (leaving the ExitStack stopped any S3 server and removed the local transport's directory)

    return report(args, out, series, per_refit, procs, before, after, codes, leftovers, final_exact, final_s,
                  dense, ids)


def report(args, out, series, per_refit, procs, before, after, codes, leftovers, final_exact, final_s,
           dense, ids) -> int:
    w = args.warmup
    post = lambda vals: list(vals[w:])  # noqa: E731
    checks = []
    for name in procs:
        s = series[name]
        checks.append(check(name, "rss_mib", post(s["rss_mib"]), "rss", args))
        checks.append(check(name, "rss_anon_mib", post(s["rss_anon_mib"]), "info", args))
        for k in COUNTS:  # threads: the executor pools apart (they grow lazily to their cap)
            checks.append(check(name, k, post(s[k]), "info" if k == "threads" else "count", args))
        checks.append(check(name, "other_threads", post(s["other_threads"]), "count", args))
        checks.append(check(name, "pool_threads", post(s["pool_threads"]), "pool", args))
        checks.append(check(name, "gc_objects", post(s["gc_objects"]), "gc", args))
        checks.append(check(name, "py_blocks", post(s["py_blocks"]), "gc", args))
        if not math.isnan(s["heap_in_use_mib"][w]):
            checks.append(check(name, "heap_in_use_mib", post(s["heap_in_use_mib"]), "heap", args))
            checks.append(check(name, "heap_free_mib", post(s["heap_free_mib"]), "info", args))
    if "s3-server" in series:
        for k in ("rss_mib", *COUNTS):
            checks.append(check("s3-server", k, post(series["s3-server"][k]), "info", args))
    for k, vals in series["transport"].items():
        kind = "by-design" if k in ("commit_records", "s3_commit_records") else "count"
        if k == "commit_records" and args.transport == "s3":
            kind = "info"  # the s3 transport keeps commit records in the bucket
        checks.append(check("transport", k, post(vals), kind, args))
    shutdown = {
        "receiver_exit_codes": codes,
        "trainer_before_setup": before,
        "trainer_after_close": after,
        "leftovers": leftovers,
    }
    shutdown_ok = (all(c == 0 for c in codes.values())
                   and all(after[k] <= before[k] for k in ("fds", "sockets", "shm", "files"))
                   and not after["new_threads"]
                   and not leftovers.get("local_segments_before_cleanup")
                   and not leftovers.get("local_dir_exists_after_cleanup", False)
                   and leftovers.get("s3_before_cleanup", {}).get("s3_other", 0) == 0
                   and leftovers.get("s3_before_cleanup", {}).get("s3_presence", 0) == 0
                   and sum(leftovers.get("s3_after_cleanup", {}).values()) == 0)
    exact = all(v == 1.0 for v in per_refit["bit_exact"])
    passed = all(c["passed"] for c in checks) and shutdown_ok and exact and final_exact

    # Table
    print()
    print(f"{'process':<10} {'metric':<16} {'first':>11} {'last':>11} {'max':>11} {'slope/refit':>12} "
          f"{'last-first':>10} {'median Δ':>10}  result")
    for c in checks:
        fmt = (lambda v: f"{v:11.2f}") if c["metric"].endswith("_mib") else (lambda v: f"{v:11.0f}")
        verdict = "pass" if c["passed"] else "FAIL"
        if c["rule"] == "reported only":
            verdict = "(info)"
        print(f"{c['process']:<10} {c['metric']:<16} {fmt(c['first'])} {fmt(c['last'])} {fmt(c['max'])} "
              f"{c['slope']:12.4f} {c['growth']:10.2f} {c['window_growth']:10.2f}  {verdict}  ({c['rule']})")
    rs = per_refit
    refit_s = sorted(rs["refit_s"][w:])
    verify_s = sorted(rs["verify_s"][w:])
    med = lambda v: v[len(v) // 2]  # noqa: E731
    print(f"\nrefits: {len(rs['version'])} committed, every one bit-exact: {'yes' if exact else 'NO'}; "
          f"final element-by-element check: {'identical' if final_exact else 'DIFFERENT'}")
    print(f"post-warm-up median refit {med(refit_s):.3f} s, median verify {med(verify_s):.3f} s, "
          f"median change rate {100 * med(sorted(rs['change_rate'][w:])):.2f}%, "
          f"median wire {med(sorted(rs['wire_bytes'][w:])) / 1e6:.2f} MB")
    shown = {k: v for k, v in leftovers.items() if k != "shm_paths_after_last_refit"}
    print(f"shutdown: receiver exit codes {codes}; trainer fds/sockets/threads before set-up "
          f"{before['fds']}/{before['sockets']}/{before['threads']}, after close "
          f"{after['fds']}/{after['sockets']}/{after['threads']} (new threads: {after['new_threads'] or 'none'}); "
          f"left behind {shown}: {'pass' if shutdown_ok else 'FAIL'}")
    print(f"soak {'PASSED' if passed else 'FAILED'}")

    res = {
        "benchmark": "soak",
        "transport": args.transport,
        "smoke": args.smoke,
        "refits": args.refits,
        "warmup": args.warmup,
        "receivers": args.receivers,
        "receiver_processes": True,
        "malloc_mmap_threshold": args.malloc_mmap_threshold,
        "model": {"family": "llama", "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                  "params": dense // 2, "dense_bytes": dense, "lr": args.lr,
                  "durable_baseline": not args.no_durable_baseline},
        "thresholds": {"rss_tol_pct": args.rss_tol_pct, "rss_tol_mib": args.rss_tol_mib,
                       "heap_tol_pct": args.heap_tol_pct, "heap_tol_mib": args.heap_tol_mib,
                       "counts": "minimum of the last fifth <= minimum of the first fifth",
                       "gc_objects_and_py_blocks": "growth and fitted growth <= max(0.1%, 100)"},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "per_refit": {k: list(v) for k, v in per_refit.items()},
        "samples": {name: {k: list(v) for k, v in s.items()} for name, s in series.items()},
        "checks": checks,
        "bit_exact_every_refit": exact,
        "final_bit_exact": final_exact,
        "final_check_s": final_s,
        "median_refit_s": med(refit_s),
        "median_verify_s": med(verify_s),
        "shutdown": {**shutdown, "passed": shutdown_ok},
        "passed": passed,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    plot(res, out.with_suffix(".png"), list(procs))
    log(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if passed else 1


def plot(res: dict, path: Path, names: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = res["warmup"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in names + (["s3-server"] if "s3-server" in res["samples"] else []):
        rss = res["samples"][name]["rss_mib"]
        x = list(range(1, len(rss) + 1))
        a.plot(x, rss, label=name, marker=".", markersize=3)
        base = rss[w]
        b.plot(x[w:], [v - base for v in rss[w:]], label=name, marker=".", markersize=3)
    for ax in (a, b):
        ax.axvspan(0.5, w + 0.5, color="0.9", label="warm-up" if ax is a else None)
        ax.set_xlabel("refit")
        ax.grid(alpha=0.3)
    a.set_ylabel("resident memory (VmRSS, MiB)")
    a.set_title(f"soak, {res['transport']} transport: RSS per process")
    b.set_ylabel("RSS - RSS after warm-up (MiB)")
    b.set_title("growth after warm-up")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
