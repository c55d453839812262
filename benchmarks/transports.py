"""Transport benchmark on loopback: payload throughput and the time to deliver one
transfer to N receiver processes, per transport.

    python benchmarks/transports.py                       # all transports, N = 1 2 4 8
    python benchmarks/transports.py --transports local --receivers 1,2 --smoke

Each receiver is a separate process (benchmarks/bench_receiver.py) that reads every
payload and acknowledges it; the producer runs here. A transfer counts as delivered
when `flush` returns, i.e. when every receiver has staged every payload. Results go
to benchmarks/results/transports.json (and a PNG plot when matplotlib is present).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
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
from nemo_dcr import registry  # noqa: E402
from nemo_dcr.records import TransferInfo  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def transport_config(name: str, receivers: list[str], workdir: Path):
    """Configuration (and any server it needs, started here) for one transport."""
    if name == "local":
        yield {"dir": str(workdir / "shm"), "timeout_s": 120, "max_in_flight_bytes": 256 << 20}
    elif name == "s3":
        from tests.support.s3_server import s3_server

        with s3_server() as config:
            yield {**config, "timeout_s": 120, "max_in_flight_bytes": 256 << 20}
    elif name == "relay":
        yield {"nodes": [{"id": r, "endpoint": f"tcp://127.0.0.1:{free_port()}"} for r in receivers],
               "coordinator": f"tcp://127.0.0.1:{free_port()}", "fanout": 2, "timeout_s": 120,
               "max_in_flight_bytes": 256 << 20}
    else:
        raise SystemExit(f"no benchmark set-up for transport {name!r}")


def begin(coord, info: TransferInfo) -> None:
    """Announce a transfer as a refit does (receivers then look for its payloads)."""
    coord.broadcast("begin", {"transfer_id": info.transfer_id, "transfer": info.to_json()})
    coord.collect("ready", info.transfer_id, 120)


def deliver(transport, coord, payloads: int, size: int, repeats: int) -> list[float]:
    """Seconds from the first send until every receiver staged `payloads` x `size` bytes."""
    prod = transport.producer("p0")
    blob = os.urandom(size)
    times = []
    try:
        for _ in range(repeats):
            info = TransferInfo(uuid.uuid4().hex[:12], 0, 1, ("p0",))
            ids = [f"p0-{i:06d}" for i in range(payloads)]
            begin(coord, info)
            t = time.perf_counter()
            for pid in ids:
                prod.send(info, pid, blob)
            rejected = prod.flush(info, ids)
            times.append(time.perf_counter() - t)
            if rejected:
                raise RuntimeError(f"receivers rejected payloads: {rejected}")
    finally:
        prod.close()
    return times


def run_one(name: str, n: int, payloads: int, size: int, repeats: int, workdir: Path) -> dict:
    receivers = [f"rx{i}" for i in range(n)]
    with transport_config(name, receivers, workdir) as config:
        transport = registry.transport(name, config, receivers=receivers)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.bench_receiver", "--transport", name,
                                   "--config", json.dumps(config), "--id", rx], cwd=REPO, env=env)
                 for rx in receivers]
        coord = transport.coordinator()
        try:
            begin(coord, TransferInfo("warmup", 0, 1, ("p0",)))  # every receiver is up
            times = deliver(transport, coord, payloads, size, repeats)
        finally:
            coord.broadcast("shutdown", {})
            coord.close()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            transport.cleanup()
    best = min(times)
    return {"transport": name, "receivers": n, "payloads": payloads, "payload_bytes": size,
            "seconds": times, "best_s": best, "throughput_MBps": payloads * size / best / 1e6}


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in sorted({r["transport"] for r in results}):
        rows = sorted((r for r in results if r["transport"] == name), key=lambda r: r["receivers"])
        ax.plot([r["receivers"] for r in rows], [r["best_s"] for r in rows], marker="o", label=name)
    ax.set_xlabel("receivers (processes)")
    ax.set_ylabel("time to deliver one transfer (s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title("One transfer to N receivers on loopback")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transports", default=",".join(registry.available("nemo_dcr.transports")))
    ap.add_argument("--receivers", default="1,2,4,8")
    ap.add_argument("--payloads", type=int, default=16)
    ap.add_argument("--payload-mib", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="seconds-long run (CI): tiny payloads, one repeat")
    ap.add_argument("--out", help="results JSON (default benchmarks/results/transports.json; "
                                  "with --smoke, the temp dir)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.payloads, args.payload_mib, args.repeats = 4, 0.0625, 1
    size = int(args.payload_mib * (1 << 20))
    results = []
    print(f"{'transport':<10}{'N':>4}{'transfer':>12}{'best s':>10}{'MB/s':>10}", flush=True)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="nemo-dcr-bench-", dir=shm) as tmp:
        for name in args.transports.split(","):
            for n in (int(x) for x in args.receivers.split(",")):
                r = run_one(name, n, args.payloads, size, args.repeats, Path(tmp) / f"{name}-{n}")
                results.append(r)
                print(f"{name:<10}{n:>4}{args.payloads * size / 1e6:>10.1f}MB{r['best_s']:>10.3f}"
                      f"{r['throughput_MBps']:>10.1f}", flush=True)
    out = results_path("transports", args.out, args.smoke)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine_info(),
            "note": "loopback; receivers are separate processes; best of repeats"}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    png = out.with_suffix(".png")
    print(f"results: {out}" + (f", plot: {png}" if plot(results, png) else " (no matplotlib: no plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
