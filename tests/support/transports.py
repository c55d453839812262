"""Open each transport on real parts for the shared conformance suite."""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from nemo_dcr import registry
from tests.support.launch import free_port
from tests.support.s3_server import payload_objects, shared_moto

TRANSPORTS = ["local", "relay", "s3"]


def open_transport(name: str, tmp_path, receivers: list[str], **config):
    """A transport of kind `name` for `receivers`, with short timeouts."""
    config.setdefault("timeout_s", 5)
    if name == "local":
        return registry.transport("local", {"dir": str(tmp_path / "shm"), **config}, receivers=receivers)
    if name == "relay":
        nodes = [{"id": r, "endpoint": f"tcp://127.0.0.1:{free_port()}"} for r in receivers]
        return registry.transport("relay", {"nodes": nodes, "coordinator": f"tcp://127.0.0.1:{free_port()}",
                                            **config}, receivers=receivers)
    if name == "s3":
        server = shared_moto()
        return registry.transport("s3", server.config(server.new_bucket(), poll_s=0.02, **config),
                                  receivers=receivers)
    raise ValueError(f"no conformance set-up for transport {name!r}")


def leftovers(t) -> list[str]:
    """Payload data the transport still stores (must be empty after a flush / cleanup)."""
    if t.name == "local":
        data = os.path.join(t.dir, "data")
        if not os.path.isdir(data):
            return []
        return sorted(os.path.relpath(os.path.join(d, f), data) for d, _, fs in os.walk(data) for f in fs)
    if t.name == "relay":
        return []  # payloads live only in flight, in ZeroMQ queues bounded by the windows
    if t.name == "s3":
        return payload_objects(t)
    raise ValueError(f"no conformance set-up for transport {t.name!r}")


def drain(end, seen, stop, delay=0.0, reject=()):
    """A receiver loop: record payload bytes, ack each (rejecting some)."""
    while not stop.is_set():
        ev = end.poll(0.05)
        if ev is None:
            continue
        if ev.kind == "payload":
            time.sleep(delay)
            seen.append((ev.meta["payload_id"], None if ev.data is None else bytes(ev.data)))
            pid = ev.meta["payload_id"]
            end.staged(ev.meta["transfer_id"], ev.meta["producer_id"], pid, "bad" if pid in reject else None)
        else:
            seen.append((ev.kind, ev.meta))
        ev.release()


def run_receivers(t, ids, **kw):
    """Receiver ends on threads running `drain`; returns (seen per receiver, finish).

    finish() stops them and fails naming any receiver whose loop died (with its
    traceback) or did not stop (with where it is stuck): a producer that timed out
    waiting for a receiver then shows why, not only that it waited."""
    stop, threads, seen, ends, died = threading.Event(), {}, {}, [], {}

    def loop(rx, end):
        try:
            drain(end, seen[rx], stop, **kw)
        except BaseException:
            died[rx] = traceback.format_exc()
            raise

    for rx in ids:
        end = t.receiver(rx)
        ends.append(end)
        seen[rx] = []
        threads[rx] = threading.Thread(target=loop, args=(rx, end), daemon=True, name=f"drain-{rx}")
        threads[rx].start()

    def finish():
        stop.set()
        for th in threads.values():
            th.join(5)
        frames = sys._current_frames()
        stuck = {rx: "".join(traceback.format_stack(frames[th.ident])) for rx, th in threads.items()
                 if th.is_alive() and th.ident in frames}
        for end in ends:
            end.close()
        problems = [f"receiver loop {rx} died:\n{tb}" for rx, tb in died.items()]
        problems += [f"receiver loop {rx} did not stop; it is at:\n{st}" for rx, st in stuck.items()]
        if problems:
            raise AssertionError("\n".join(problems))

    return seen, finish


class KeepingEnd:
    """A producer end that keeps what it is sent (`payloads`, in order) and delivers nothing:
    for tests that decode a producer's payloads themselves."""

    def __init__(self):
        self.payloads: list[bytes] = []

    def send(self, transfer, payload_id, data):
        self.payloads.append(bytes(data))

    def flush(self, transfer, payload_ids):
        return {}

    def close(self):
        pass
