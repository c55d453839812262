"""Same-host transport (the embedded default): shared memory plus ZeroMQ `ipc://`.

Each payload is written once into a file on a tmpfs (`/dev/shm`, i.e. POSIX shared
memory) and every receiver maps it read-only; only a small JSON notice travels over
the socket. The producer removes a segment when every receiver has staged it, and
blocks in `send` while the bytes not yet staged everywhere exceed
`max_in_flight_bytes`: a slow receiver back-pressures its producers, and shared
memory use stays bounded.

CUDA tensors (1-D uint8) sent instead of bytes travel by CUDA IPC: the producer exports
a handle to the device memory (NVLink / PCIe peer access between GPUs of the node), the
receiver maps it and gets a device tensor; no host copy is made by the transport. The
producer keeps the tensor alive until every receiver staged it. CUDA IPC cannot map
memory into the process that owns it, so a receiver in the producer's own process (on a
thread) is handed the producer's tensor itself.

Configuration (all optional): dir (default /dev/shm/nemo-dcr), max_in_flight_bytes
(default 256 MiB), timeout_s (default 120).
"""

from __future__ import annotations

import base64
import itertools
import mmap
import os
import shutil
import time

import zmq

from nemo_dcr.errors import TransportError
from nemo_dcr.records import TransferInfo
from nemo_dcr.transport import (
    CoordinatorEnd,
    Event,
    ProducerEnd,
    ReceiverEnd,
    Transport,
    dumps,
    loads,
)

DEFAULTS = {"dir": "/dev/shm/nemo-dcr", "max_in_flight_bytes": 256 << 20, "timeout_s": 120.0}

# Device payloads in flight from producers of this process, by token: what a receiver in
# the same process takes instead of mapping the CUDA IPC handle.
_IN_PROCESS: dict[str, object] = {}
_TOKENS = itertools.count()


class LocalTransport(Transport):
    name = "local"

    def __init__(self, config=None, *, receivers=None):
        super().__init__({**DEFAULTS, **(config or {})}, receivers=receivers)
        self.dir = os.fspath(self.config["dir"])
        self.timeout_s = float(self.config["timeout_s"])
        self.max_in_flight = int(self.config["max_in_flight_bytes"])
        if self.max_in_flight <= 0:
            raise ValueError(f"local transport: max_in_flight_bytes must be > 0, got {self.max_in_flight}")
        os.makedirs(os.path.join(self.dir, "sock"), exist_ok=True)
        os.makedirs(os.path.join(self.dir, "data"), exist_ok=True)

    def endpoint(self, role: str, ident: str = "") -> str:
        return f"ipc://{os.path.join(self.dir, 'sock', f'{role}-{ident}' if ident else role)}"

    def producer(self, producer_id):
        return _LocalProducer(self, producer_id)

    def receiver(self, receiver_id):
        return _LocalReceiver(self, receiver_id)

    def coordinator(self):
        if not self.receivers:
            raise ValueError("local transport: a coordinator needs the list of receiver ids")
        return _LocalCoordinator(self)

    def cleanup(self):
        shutil.rmtree(self.dir, ignore_errors=True)


class _Sockets:
    """A zmq context plus PUSH sockets opened lazily per destination."""

    def __init__(self, transport: LocalTransport):
        self.t = transport
        self.ctx = zmq.Context()
        self.push: dict[str, zmq.Socket] = {}

    def bind_pull(self, endpoint: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.PULL)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(endpoint)
        return s

    def send(self, endpoint: str, msg: dict, who: str) -> None:
        s = self.push.get(endpoint)
        if s is None:
            s = self.ctx.socket(zmq.PUSH)
            # Fail instead of queueing for a peer that is not there.
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.SNDTIMEO, int(self.t.timeout_s * 1000))
            s.setsockopt(zmq.LINGER, int(self.t.timeout_s * 1000))
            s.connect(endpoint)
            self.push[endpoint] = s
        try:
            s.send(dumps(msg))
        except zmq.Again:
            raise TransportError(
                f"local transport: {who} at {endpoint} did not accept a message within {self.t.timeout_s:.0f} s"
            ) from None

    def close(self):
        for s in self.push.values():
            s.close()
        self.ctx.term()


def _recv(sock: zmq.Socket, timeout_s: float) -> dict | None:
    if sock.poll(int(max(timeout_s, 0) * 1000)) == 0:
        return None
    return loads(sock.recv())


class _LocalProducer(ProducerEnd):
    carries_device_tensors = True

    def __init__(self, t: LocalTransport, producer_id: str):
        self.t, self.id = t, producer_id
        self.net = _Sockets(t)
        self.acks = self.net.bind_pull(t.endpoint("prod", producer_id))
        # payload -> (segment path or device payload token, size, receivers still to stage it)
        self.in_flight: dict[str, tuple[object, int, set[str]]] = {}
        self.in_flight_bytes = 0
        self.rejected: dict[str, dict[str, str]] = {}

    def send(self, transfer, payload_id, data):
        size = len(data)
        while self.in_flight and self.in_flight_bytes + size > self.t.max_in_flight:
            self._wait_ack(transfer)  # back-pressure: the slowest receiver sets the pace
        note = {"kind": "payload", "transfer_id": transfer.transfer_id, "producer_id": self.id,
                "payload_id": payload_id, "size": size}
        if _is_cuda(data):
            note["cuda_ipc"] = _export_cuda(data)
            token = note["cuda_ipc"]["in_process"] = f"{os.getpid()}:{next(_TOKENS)}"
            _IN_PROCESS[token] = data
            keep = token  # the device memory must outlive every receiver's mapping (_release drops it)
        else:
            folder = os.path.join(self.t.dir, "data", transfer.transfer_id)
            os.makedirs(folder, exist_ok=True)
            keep = note["path"] = os.path.join(folder, f"{payload_id}.ndcr")
            tmp = keep + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, keep)  # receivers never see a half-written segment
        self.in_flight[payload_id] = (keep, size, set(self.t.receivers))
        self.in_flight_bytes += size
        for r in self.t.receivers:
            self.net.send(self.t.endpoint("rx", r), note, f"receiver {r}")

    def flush(self, transfer, payload_ids):
        manifest = {"kind": "manifest", "transfer_id": transfer.transfer_id, "producer_id": self.id,
                    "payload_ids": list(payload_ids)}
        for r in self.t.receivers:
            self.net.send(self.t.endpoint("rx", r), manifest, f"receiver {r}")
        while self.in_flight:
            self._wait_ack(transfer)
        folder = os.path.join(self.t.dir, "data", transfer.transfer_id)
        try:
            os.rmdir(folder)  # other producers of the transfer may still have segments there
        except OSError:
            pass
        rejected, self.rejected = self.rejected, {}
        return rejected

    def _wait_ack(self, transfer: TransferInfo):
        deadline = time.monotonic() + self.t.timeout_s
        while True:
            msg = _recv(self.acks, deadline - time.monotonic())
            if msg is None:
                waiting = sorted({r for _, _, w in self.in_flight.values() for r in w})
                raise TransportError(
                    f"local transport: receivers {waiting} did not stage {len(self.in_flight)} payload(s) of "
                    f"transfer {transfer.transfer_id} within {self.t.timeout_s:.0f} s"
                )
            entry = self.in_flight.get(msg.get("payload_id"))
            if msg.get("kind") != "staged" or entry is None:
                continue  # stale or duplicate acknowledgement
            keep, size, waiting = entry
            waiting.discard(msg.get("receiver"))
            if msg.get("error"):
                self.rejected.setdefault(msg["receiver"], {})[msg["payload_id"]] = msg["error"]
            if not waiting:
                del self.in_flight[msg["payload_id"]]
                self.in_flight_bytes -= size
                _release(keep)
                return

    def close(self):
        for keep, _, _ in self.in_flight.values():
            _release(keep)
        self.in_flight.clear()
        self.acks.close()
        self.net.close()


class _LocalReceiver(ReceiverEnd):
    def __init__(self, t: LocalTransport, receiver_id: str):
        self.t, self.id = t, receiver_id
        self.net = _Sockets(t)
        self.inbox = self.net.bind_pull(t.endpoint("rx", receiver_id))

    def poll(self, timeout_s):
        msg = _recv(self.inbox, timeout_s)
        if msg is None:
            return None
        if msg["kind"] != "payload":
            return Event(msg["kind"], msg)
        if "cuda_ipc" in msg:
            return Event("payload", msg, _import_cuda(msg["cuda_ipc"]))
        try:
            with open(msg["path"], "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    return Event("payload", msg, b"")
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            msg["error"] = f"shared-memory segment unreadable: {e.strerror}"
            return Event("payload", msg, None)
        view = memoryview(mm)

        def release():
            view.release()
            mm.close()

        return Event("payload", msg, view, release)

    def staged(self, transfer_id, producer_id, payload_id, error):
        self.net.send(self.t.endpoint("prod", producer_id),
                      {"kind": "staged", "transfer_id": transfer_id, "payload_id": payload_id,
                       "receiver": self.id, "error": error}, f"producer {producer_id}")

    def reply(self, kind, meta):
        self.net.send(self.t.endpoint("coord"), {**meta, "kind": kind, "receiver": self.id}, "the coordinator")

    def close(self):
        self.inbox.close()
        self.net.close()


class _LocalCoordinator(CoordinatorEnd):
    def __init__(self, t: LocalTransport):
        self.t = t
        self.net = _Sockets(t)
        self.inbox = self.net.bind_pull(t.endpoint("coord"))

    def broadcast(self, kind, meta):
        for r in self.t.receivers:
            self.net.send(self.t.endpoint("rx", r), {**meta, "kind": kind}, f"receiver {r}")

    def collect(self, kind, transfer_id, timeout_s):
        replies: dict[str, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(self.t.receivers):
            msg = _recv(self.inbox, deadline - time.monotonic())
            if msg is None:
                missing = sorted(set(self.t.receivers) - set(replies))
                raise TransportError(
                    f"local transport: receivers {missing} sent no '{kind}' for transfer {transfer_id} "
                    f"within {timeout_s:.0f} s"
                )
            mine = msg.get("transfer_id") == transfer_id and msg.get("receiver") in self.t.receivers
            if msg["kind"] == kind and mine:
                replies[msg["receiver"]] = msg
            else:
                self.passed_over(msg, kind, transfer_id)
        return replies

    def close(self):
        self.inbox.close()
        self.net.close()


def _release(keep) -> None:
    """Drop what backs a staged payload: a shared-memory segment, or a device tensor."""
    if keep in _IN_PROCESS:
        del _IN_PROCESS[keep]
        return
    try:
        os.unlink(keep)
    except FileNotFoundError:
        pass


def _is_cuda(data) -> bool:
    return getattr(data, "is_cuda", False)


def _export_cuda(t) -> dict:
    """A JSON-safe CUDA IPC handle for a 1-D uint8 device tensor (as torch.multiprocessing
    shares CUDA tensors, without pickle)."""
    import torch

    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise TypeError("local transport: a device payload must be a contiguous 1-D uint8 CUDA tensor")
    (device, handle, storage_bytes, storage_offset, ref_handle, ref_offset, event_handle,
     event_sync) = t.untyped_storage()._share_cuda_()
    b64 = lambda b: base64.b64encode(b).decode() if b else None  # noqa: E731
    return {"device": device, "handle": b64(handle), "storage_bytes": storage_bytes,
            "storage_offset": storage_offset, "ref_handle": b64(ref_handle), "ref_offset": ref_offset,
            "event_handle": b64(event_handle), "event_sync": event_sync,
            "tensor_offset": t.storage_offset(), "numel": t.numel()}


def _import_cuda(h: dict):
    """Map a producer's device memory (the inverse of _export_cuda); in the producer's own
    process, its tensor."""
    import torch

    own = _IN_PROCESS.get(h.get("in_process", ""))
    if own is not None:
        return own

    unb64 = lambda s: None if s is None else base64.b64decode(s)  # noqa: E731
    torch.cuda.init()  # mapping a handle in a process whose CUDA state is not set up yet segfaults
    storage = torch.UntypedStorage._new_shared_cuda(
        h["device"], unb64(h["handle"]), h["storage_bytes"], h["storage_offset"], unb64(h["ref_handle"]),
        h["ref_offset"], unb64(h["event_handle"]), h["event_sync"])
    t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{h['device']}")
    return t.set_(storage, h["tensor_offset"], (h["numel"],), (1,))
