"""Launch worker scripts under torchrun from tests, with hard time limits."""

from __future__ import annotations

import os
import signal
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TORCHRUN_TIMEOUT_S = 240


def free_port() -> int:
    """A free TCP port on loopback, below the kernel's ephemeral range: a port that peers
    keep reconnecting to while its node is down must not become some socket's ephemeral
    port (or a self-connect of the reconnecting socket), or the restarted node cannot bind
    it again. Never one this process was given before: the port is only reserved once
    bound, so two nodes of one cluster drawing the same free port would collide."""
    low = _ephemeral_low()
    for _ in range(500):
        port = _PORTS.randrange(10000, low) if low > 12000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
    raise RuntimeError("no free TCP port on 127.0.0.1 below the ephemeral range")


_PORTS = random.Random()
_GIVEN: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def worker_env() -> dict:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        # CPU path everywhere (a CUDA build then sees no GPU and the shim takes over).
        CUDA_VISIBLE_DEVICES="",
        PYTHONWARNINGS="ignore",
        HF_HUB_OFFLINE="1",
    )
    return env


def run(cmd: list[str], timeout: float) -> tuple[int, str]:
    """Run `cmd` in its own process group; kill the whole group on timeout."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, out + f"\n[test] killed after {timeout}s"
    return proc.returncode, out


def torchrun(nproc: int, worker: Path, *args: str, ok_marker: str, timeout: float = TORCHRUN_TIMEOUT_S) -> str:
    """Run `worker` on `nproc` ranks; fail the test unless it exits 0 and prints `ok_marker`."""
    for _attempt in range(2):  # a port picked free can be taken before torchrun binds it
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()),
            str(worker), *args,
        ]
        rc, out = run(cmd, timeout)
        if rc == 0 or "address already in use" not in out.lower():
            break
    if rc != 0 or ok_marker not in out:
        tail = "\n".join(
            line for line in out.splitlines() if "Warning" not in line and "warn" not in line
        )[-6000:]
        pytest.fail(f"torchrun exited {rc}:\n{tail}")
    return out


def run_worker(main) -> None:
    """Entry point of a torchrun worker: any failure exits 1 at once, so the other
    ranks are torn down by torchrun instead of hanging in a collective."""
    import traceback

    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
