"""Start a relay tree of N nodes as separate processes on 127.0.0.1 (tests only).

Two kinds of node process:
  - `checkpoint=None`: tests/workers/relay_node.py, a relay end with a scripted
    receiver loop (for transport-level tests; per-node flags via `node_args`);
  - `checkpoint=DIR`: the real receiver, `python -m nemo_dcr.cli receive --transport
    relay --transport-config JSON --id rxK` (a Hugging Face model refitted in place).

Every process runs in its own session and is killed (with its group) on exit from the
context manager if it has not ended by then; `shutdown()` asks the nodes to shut down
through the coordinator (`wait()` gives the exit codes). For repair tests a single node
can be killed or signalled (`kill_node`, `signal_node`) and started again with the same
id and endpoint (`restart_node`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nemo_dcr.transports.relay import RelayTransport
from tests.support.launch import REPO, free_port, worker_env

WORKER = REPO / "tests" / "workers" / "relay_node.py"


class RelayCluster:
    def __init__(self, n: int, workdir: Path, *, fanout: int = 2, timeout_s: float = 5.0,
                 node_args: dict[int, list[str]] | None = None, absent: tuple[int, ...] = (),
                 checkpoint: str | os.PathLike | None = None, **config):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ids = [f"rx{i}" for i in range(n)]
        self.config = {"nodes": [{"id": rx, "endpoint": f"tcp://127.0.0.1:{free_port()}"} for rx in self.ids],
                       "fanout": fanout, "coordinator": f"tcp://127.0.0.1:{free_port()}",
                       "timeout_s": timeout_s, **config}
        self.node_args = node_args or {}
        self.absent = set(absent)
        self.checkpoint = checkpoint
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def transport(self) -> RelayTransport:
        return RelayTransport(self.config)

    def endpoint(self, i: int) -> str:
        return self.config["nodes"][i]["endpoint"]

    def out(self, rx: str) -> Path:
        return self.workdir / f"{rx}.json"

    def command(self, i: int) -> list[str]:
        rx, cfg = self.ids[i], json.dumps(self.config)
        if self.checkpoint is None:
            return [sys.executable, str(WORKER), "--config", cfg, "--id", rx, "--out", str(self.out(rx)),
                    *self.node_args.get(i, [])]
        head = [sys.executable, "-m", "nemo_dcr.cli"]
        return [*head, "receive", "--checkpoint", str(self.checkpoint), "--transport", "relay",
                "--transport-config", cfg, "--id", rx]

    def start(self, ready_timeout: float = 60.0) -> RelayCluster:
        for i in range(len(self.ids)):
            if i not in self.absent:
                self._launch(i, self.workdir / f"{self.ids[i]}.log")
        self._wait_ready(set(self.procs), ready_timeout)
        return self

    def _launch(self, i: int, log_path: Path) -> None:
        rx = self.ids[i]
        self.logs[rx] = log_path
        with open(log_path, "wb") as log:
            self.procs[rx] = subprocess.Popen(self.command(i), cwd=REPO, env=worker_env(), stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True)

    def kill_node(self, i: int) -> None:
        """SIGKILL node i (with its process group) and wait until it is gone."""
        p = self.procs[self.ids[i]]
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(20)

    def signal_node(self, i: int, sig: int) -> None:
        """Send `sig` (e.g. SIGSTOP / SIGCONT) to node i's process group."""
        os.killpg(self.procs[self.ids[i]].pid, sig)

    def restart_node(self, i: int, ready_timeout: float = 30.0, args: list[str] | None = None) -> None:
        """Start node i again, same id and endpoint (after it ended), with `args` instead of
        its `node_args` if given; a new log file; returns once it is ready."""
        rx = self.ids[i]
        old = self.procs.get(rx)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"node {rx} is still running (pid {old.pid}); kill it first")
        if args is not None:
            self.node_args[i] = list(args)
        n = sum(1 for p in self.workdir.glob(f"{rx}.*.log")) + 1
        self._launch(i, self.workdir / f"{rx}.{n}.log")
        self._wait_ready({rx}, ready_timeout)

    def _wait_ready(self, waiting: set[str], ready_timeout: float) -> None:
        marker = "READY" if self.checkpoint is None else "serving version 0"
        deadline = time.monotonic() + ready_timeout
        waiting = set(waiting)
        while waiting:
            for rx in sorted(waiting):
                if marker in self.log(rx):
                    waiting.discard(rx)
                elif self.procs[rx].poll() is not None:
                    raise RuntimeError(f"node {rx} exited {self.procs[rx].returncode}:\n{self.log(rx)[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes {sorted(waiting)} not ready in {ready_timeout} s")
            time.sleep(0.05)

    def log(self, rx: str) -> str:
        try:
            return self.logs[rx].read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def result(self, rx: str) -> dict:
        return json.loads(self.out(rx).read_text())

    def shutdown(self, timeout: float = 20.0) -> dict[str, int]:
        """Ask every node to shut down through the coordinator; wait; exit codes."""
        coord = self.transport().coordinator()
        try:
            coord.broadcast("shutdown", {})
        finally:
            coord.close()
        return self.wait(timeout)

    def terminate(self, timeout: float = 20.0) -> dict[str, int]:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for rx, p in self.procs.items():
            try:
                codes[rx] = p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                codes[rx] = None
        return codes

    def kill(self) -> list[str]:
        """Kill whatever still runs (with its process group); the nodes that had to be killed."""
        killed = []
        for rx, p in self.procs.items():
            if p.poll() is None:
                killed.append(rx)
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # its own session: whatever it started goes too
                except ProcessLookupError:
                    pass
                p.wait()
        return killed

    def __enter__(self) -> RelayCluster:
        try:
            return self.start()
        except BaseException:
            self.kill()
            raise

    def __exit__(self, *exc) -> None:
        self.kill()
