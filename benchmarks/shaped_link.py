"""What the link benchmarks share: a loopback shaped with `tc tbf` inside a private network
namespace (the kernel here has no netem), and a probe of the rate one TCP stream gets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time


def run_shaped(script: str, argv: list[str], mbit: int, log, refuse: str) -> int:
    """Create a namespace, shape its loopback to `mbit` Mbit/s, run `script argv --inside`
    there, and remove the namespace. `refuse`: the message when not root."""
    if os.geteuid() != 0:
        raise SystemExit(refuse)
    ns = f"nemo-dcr-{os.path.basename(script).split('.')[0]}-{os.getpid()}"
    # At least one timer tick of data, and a few of the loopback's 64 KiB packets: tbf drops
    # a packet larger than its burst, which stalls TCP on slow links.
    burst = max(256 * 1024, int(mbit * 1e6 / 8 / 250))
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{mbit}mbit",
                        "burst", str(burst), "latency", "50ms"], check=True)
        log(f"namespace {ns}: loopback shaped to {mbit} Mbit/s (tbf, burst {burst} B)")
        return subprocess.call(["ip", "netns", "exec", ns, sys.executable, script, *argv, "--inside"])
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def measure_link(nbytes: int) -> float:
    """Bits per second of one TCP stream over the loopback (the shaped link)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got = []

    def sink():
        conn, _ = srv.accept()
        n = 0
        while chunk := conn.recv(1 << 20):
            n += len(chunk)
        got.append(n)
        conn.close()

    th = threading.Thread(target=sink)
    th.start()
    block = os.urandom(1 << 20)
    t = time.perf_counter()
    with socket.create_connection(srv.getsockname()) as c:
        for _ in range(nbytes >> 20):
            c.sendall(block)
    th.join()
    seconds = time.perf_counter() - t
    srv.close()
    return got[0] * 8 / seconds
