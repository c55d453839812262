"""Relay-tree transport: each producer sends a payload once, to the root relay of the
rollout cluster, and the relays fan it out.

Topology: `nodes` is an ordered list of {"id": receiver_id, "endpoint": "tcp://host:port"}
(optional "bind", default the endpoint); node 0 is the root, the children of node i are
nodes fanout*i+1 .. fanout*i+fanout (`fanout`, default 2).

The relay is the receiver end: `receiver(rx_id)` binds the node's ROUTER and starts one
thread that owns all the node's sockets. It hands each payload to the local Receiver
through a bounded queue (`poll()`), forwards the same zmq frame (no copy) to each child,
and acks it to its sender (producer or parent) only once the local Receiver `staged()` it
and every child acked it. Acks carry the subtree's outcome (how many staged, who rejected
and why, who was lost and why), so the root's ack means "staged on every node" and
`flush` returns per-receiver rejections like the local transport.

Back-pressure: a relay sends a child at most `window_bytes` / `window_payloads` unacked;
it holds at most what its sender's window lets through (a producer's: max_in_flight_bytes).
A slow node stalls its parent's window, then the parent's acks, up to the producer's
`send`. ZeroMQ high-water marks (`hwm`) bound the socket queues too.

Control: the coordinator talks to every node directly (so a failed interior relay hides
no one and every silent node is named); nodes reply to its `coordinator` endpoint.
Manifests go down the tree with the data.

Failures: a node gives up on a busy link (child or local receiver) without progress for
timeout_s * (height + 1 - depth) / (height + 2): its subtree is lost for that transfer,
the acks carry that up, and the producer raises a TransportError naming node and
endpoint. Deeper links give up first, so the node nearest the cause is named; the producer
waits timeout_s for the root. Delivery is at least once: a re-sent payload still in the
tree is merged (each sender acked), later it travels again (receivers dedup by id).
Payloads travel as raw frames, control as JSON; nothing is pickled.

Configuration: nodes, fanout (2), coordinator (tcp endpoint), coordinator_bind,
timeout_s (120), max_in_flight_bytes (256 MiB, per producer), window_bytes (64 MiB) and
window_payloads (256) per link, hwm (1024), local_queue (64).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import zmq

from nemo_dcr.errors import TransportError
from nemo_dcr.transport import CoordinatorEnd, Event, ProducerEnd, ReceiverEnd, Transport, dumps, loads

log = logging.getLogger(__name__)

DEFAULTS = {"fanout": 2, "timeout_s": 120.0, "max_in_flight_bytes": 256 << 20, "window_bytes": 64 << 20,
            "window_payloads": 256, "hwm": 1024, "local_queue": 64}
LOCAL = -1  # the local receiver's slot in an entry's `waiting` set (children use their node index)


class RelayTransport(Transport):
    name = "relay"

    def __init__(self, config=None, *, receivers=None):
        cfg = {**DEFAULTS, **(config or {})}
        nodes = cfg.get("nodes")
        if not isinstance(nodes, list) or not nodes:
            raise ValueError("relay transport: config needs 'nodes', a list of {'id': ..., 'endpoint': 'tcp://...'}")
        for i, n in enumerate(nodes):
            if not (isinstance(n, dict) and n.get("id") and isinstance(n["id"], str)
                    and str(n.get("endpoint", "")).startswith("tcp://")):
                raise ValueError(f"relay transport: node {i} must be {{'id': str, 'endpoint': 'tcp://host:port'}}, "
                                 f"got {n!r}")
        self.nodes = [dict(n) for n in nodes]
        self.ids = [n["id"] for n in self.nodes]
        if len(set(self.ids)) != len(self.ids):
            raise ValueError(f"relay transport: node ids must be unique, got {self.ids}")
        if receivers and sorted(receivers) != sorted(self.ids):
            raise ValueError(f"relay transport: receivers {sorted(receivers)} are not the nodes {sorted(self.ids)}")
        super().__init__(cfg, receivers=list(receivers or self.ids))
        for key in ("fanout", "timeout_s", "max_in_flight_bytes", "window_bytes", "window_payloads", "hwm",
                    "local_queue"):
            if not float(cfg[key]) > 0:
                raise ValueError(f"relay transport: {key} must be > 0, got {cfg[key]!r}")
        self.fanout, self.timeout_s = int(cfg["fanout"]), float(cfg["timeout_s"])
        self.max_in_flight = int(cfg["max_in_flight_bytes"])
        self.window_bytes, self.window_payloads = int(cfg["window_bytes"]), int(cfg["window_payloads"])
        self.hwm, self.local_queue = int(cfg["hwm"]), int(cfg["local_queue"])
        self.height = self.depth(len(self.nodes) - 1)

    # --- topology (pure functions of the configuration, the same in every process) ----

    def children(self, i: int) -> list[int]:
        return [c for c in range(self.fanout * i + 1, self.fanout * i + self.fanout + 1) if c < len(self.nodes)]

    def parent(self, i: int) -> int | None:
        return None if i == 0 else (i - 1) // self.fanout

    def depth(self, i: int) -> int:
        d = 0
        while i:
            i, d = (i - 1) // self.fanout, d + 1
        return d

    def subtree(self, i: int) -> list[str]:
        return [self.ids[i]] + [rx for c in self.children(i) for rx in self.subtree(c)]

    def link_timeout(self, i: int) -> float:
        """How long node i waits for progress from a child or its local receiver."""
        return self.timeout_s * (self.height + 1 - self.depth(i)) / (self.height + 2)

    def index(self, receiver_id: str) -> int:
        try:
            return self.ids.index(receiver_id)
        except ValueError:
            raise ValueError(f"relay transport: {receiver_id!r} is not one of the nodes {self.ids}") from None

    def endpoint(self, i: int) -> str:
        return self.nodes[i]["endpoint"]

    def who(self, i: int) -> str:
        return f"{'root relay' if i == 0 else 'relay'} {self.ids[i]} at {self.endpoint(i)}"

    # --- ends ---------------------------------------------------------------------------

    def producer(self, producer_id):
        return _Producer(self, producer_id)

    def receiver(self, receiver_id):
        return _RelayNode(self, receiver_id)

    def coordinator(self):
        if not self.config.get("coordinator"):
            raise ValueError("relay transport: a coordinator needs config['coordinator'] (a tcp endpoint)")
        return _Coordinator(self)


def nodes_from_mpi(comm, port_base: int, *, host: str | None = None, receiver_id: str | None = None) -> list[dict]:
    """The `nodes` list for receivers launched with mpirun (collective over `comm`).

    Rank r is node r (rank 0 is the root) with id `receiver_id` (default f"rx{r}") at
    tcp://<host>:<port_base + r>; host defaults to this machine's address. Every rank
    gets the same list. Exchanged as JSON bytes (Allgatherv), never pickled.
    """
    try:
        import numpy as np
        from mpi4py import MPI  # noqa: F401 - imported to fail clearly when MPI is missing
    except ImportError as e:
        raise RuntimeError("relay transport: nodes_from_mpi needs mpi4py and an MPI library "
                           f"(e.g. `pip install mpi4py mpich`): {e}") from None
    rank = comm.Get_rank()
    host = host or socket.gethostbyname(socket.gethostname())
    mine = np.frombuffer(json.dumps({"id": receiver_id or f"rx{rank}",
                                     "endpoint": f"tcp://{host}:{port_base + rank}"}).encode(), np.uint8)
    sizes = np.zeros(comm.Get_size(), np.int64)
    comm.Allgather(np.array([mine.size], np.int64), sizes)
    buf = np.empty(int(sizes.sum()), np.uint8)
    comm.Allgatherv(mine, [buf, sizes.tolist()])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    nodes = [json.loads(bytes(buf[s:s + n])) for s, n in zip(starts.tolist(), sizes.tolist())]
    ids = [n["id"] for n in nodes]
    if len(set(ids)) != len(ids):
        raise ValueError(f"relay transport: MPI ranks gave duplicate receiver ids {ids}")
    return nodes


def _socket(ctx: zmq.Context, kind: int, t: RelayTransport, linger_ms: int = 0) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, linger_ms)
    s.setsockopt(zmq.SNDHWM, t.hwm)
    s.setsockopt(zmq.RCVHWM, t.hwm)
    return s


def _dealer(ctx: zmq.Context, t: RelayTransport, role: str, endpoint: str, linger_ms: int = 0) -> zmq.Socket:
    s = _socket(ctx, zmq.DEALER, t, linger_ms)
    s.setsockopt(zmq.ROUTING_ID, f"{role}:{uuid.uuid4().hex[:12]}".encode())
    s.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer that is not connected
    s.connect(endpoint)
    return s


def _release(view: memoryview) -> None:
    try:
        view.release()
    except BufferError:  # a consumer still holds a view; freed with the last reference
        pass


def _trim(d: dict, keep: int = 64) -> None:
    while len(d) > keep:
        d.pop(next(iter(d)))


# --- producer --------------------------------------------------------------------------

class _Producer(ProducerEnd):
    def __init__(self, t: RelayTransport, producer_id: str):
        self.t, self.id = t, producer_id
        self.ctx = zmq.Context()
        self.sock = _dealer(self.ctx, t, f"producer:{producer_id}", t.endpoint(0))
        self.sock.setsockopt(zmq.SNDTIMEO, int(t.timeout_s * 1000))
        self.in_flight: dict[tuple[str, str], int] = {}  # (transfer, payload) -> bytes, not yet staged everywhere
        self.in_flight_bytes = 0
        self.rejected: dict[str, dict[str, dict[str, str]]] = {}  # transfer -> receiver -> payload -> why

    def send(self, transfer, payload_id, data):
        self._drain()
        while self.in_flight and (self.in_flight_bytes + len(data) > self.t.max_in_flight
                                  or len(self.in_flight) >= self.t.window_payloads):
            self._wait_ack(transfer.transfer_id)  # back-pressure: the slowest node sets the pace
        head = dumps({"kind": "payload", "transfer_id": transfer.transfer_id, "producer_id": self.id,
                      "payload_id": payload_id, "size": len(data)})
        self._send([head, data], f"payload {payload_id}")
        key = (transfer.transfer_id, payload_id)
        if key not in self.in_flight:  # a retry under the same id is one payload in flight
            self.in_flight[key] = len(data)
            self.in_flight_bytes += len(data)

    def flush(self, transfer, payload_ids):
        self._send([dumps({"kind": "manifest", "transfer_id": transfer.transfer_id, "producer_id": self.id,
                           "payload_ids": list(payload_ids)})], "the manifest")
        while self.in_flight:
            self._wait_ack(transfer.transfer_id)
        return self.rejected.pop(transfer.transfer_id, {})

    def _send(self, frames: list, what: str) -> None:
        try:
            self.sock.send_multipart(frames, copy=False)
        except zmq.Again:
            self._fail(f"relay transport: {self.t.who(0)} did not accept {what} within {self.t.timeout_s:.0f} s "
                       f"(not running or unreachable)")

    def _fail(self, message: str):
        # The transfer is lost; forget it so the next one starts with an empty window
        # (late acks of this one are ignored as stale).
        self.in_flight.clear()
        self.in_flight_bytes = 0
        raise TransportError(message)

    def _wait_ack(self, transfer_id: str) -> None:
        if not self.sock.poll(int(self.t.timeout_s * 1000)):
            self._fail(f"relay transport: {self.t.who(0)} acknowledged none of {len(self.in_flight)} payload(s) "
                       f"of transfer {transfer_id} within {self.t.timeout_s:.0f} s")
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                msg = loads(self.sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            except TransportError as e:
                log.warning("producer %s: %s", self.id, e)
                continue
            tid, pid = msg.get("transfer_id"), msg.get("payload_id")
            size = self.in_flight.pop((tid, pid), None) if msg.get("kind") == "ack" else None
            if size is None:
                continue  # stale or duplicate acknowledgement
            self.in_flight_bytes -= size
            for rx, why in (msg.get("rejected") or {}).items():
                self.rejected.setdefault(tid, {}).setdefault(rx, {})[pid] = why
            lost = msg.get("lost") or {}
            if lost:
                self.rejected.pop(tid, None)
                self._fail(f"relay transport: receivers {sorted(lost)} did not stage payload {pid} of transfer "
                           f"{tid}: " + "; ".join(sorted(set(lost.values()))))
            answered = int(msg.get("staged") or 0) + len(msg.get("rejected") or {})
            if answered != len(self.t.nodes):
                self._fail(f"relay transport: the ack of payload {pid} accounts for {answered} of "
                           f"{len(self.t.nodes)} receivers: do all nodes share this 'nodes' configuration?")
            _trim(self.rejected)

    def close(self):
        self.in_flight.clear()
        self.sock.close(0)
        self.ctx.term()


# --- relay node (the receiver end) -----------------------------------------------------

@dataclass
class _Entry:
    """A payload a relay holds until its local receiver and every child answered."""

    key: tuple[str, str, str]  # (transfer, producer, payload)
    head: bytes  # the JSON header frame, forwarded unchanged
    data: zmq.Frame  # shared, not copied, by the local event and every child's send
    size: int
    upstream: list[bytes]  # routing ids (producer or parent) to acknowledge
    waiting: set = field(default_factory=set)  # link indexes still to answer
    staged: int = 0
    rejected: dict = field(default_factory=dict)
    lost: dict = field(default_factory=dict)


@dataclass
class _Link:
    """A child relay (a DEALER), or, with index LOCAL and no socket, the local receiver."""

    index: int
    id: str
    endpoint: str
    subtree: list[str]  # the receivers behind this link
    sock: zmq.Socket | None = None
    queue: deque = field(default_factory=deque)  # ("p", key) | ("m", manifest frame), in arrival order
    inflight: dict = field(default_factory=dict)  # key -> size: sent, not yet answered
    inflight_bytes: int = 0
    last: float = 0.0  # last progress: an answer, or the moment the link became busy
    dead: dict = field(default_factory=dict)  # transfer -> why this link was given up for it

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.inflight)

    def touch(self) -> None:
        if not self.busy:
            self.last = time.monotonic()


class _RelayNode(ReceiverEnd):
    def __init__(self, t: RelayTransport, receiver_id: str):
        self.t, self.id = t, receiver_id
        self.index = t.index(receiver_id)
        self.endpoint = t.endpoint(self.index)
        self.timeout = t.link_timeout(self.index)
        self.events: queue.Queue = queue.Queue(maxsize=t.local_queue)  # bounded hand-off to poll()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # staged()/reply() -> forwarding thread
        self._rfd, self._wfd = os.pipe()  # wakes the forwarding thread's poller
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._stop, self._overflow, self._error = False, False, None
        self.stats = {"payloads": 0, "held_bytes": 0, "peak_held_bytes": 0, "peak_link_bytes": 0, "lost": 0}
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"relay-{receiver_id}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self.close()
            raise self._error

    # --- ReceiverEnd (the local Receiver's thread) -------------------------------------

    def poll(self, timeout_s):
        if self._error is not None:
            raise TransportError(f"relay {self.id}: forwarding stopped: {self._error}")
        try:
            event = self.events.get(timeout=max(timeout_s, 0))
        except queue.Empty:
            return None
        if self._overflow:
            self._wake()  # room in the queue again: let the forwarding thread refill it
        return event

    def staged(self, transfer_id, producer_id, payload_id, error):
        self._commands.put(("staged", (transfer_id, producer_id, payload_id), error))
        self._wake()

    def reply(self, kind, meta):
        self._commands.put(("reply", {**meta, "kind": kind, "receiver": self.id}))
        self._wake()

    def close(self):
        if self._thread.is_alive():
            self._stop = True
            self._wake()
            self._thread.join(self.t.timeout_s + 10)
        if self._rfd is not None:
            os.close(self._rfd)
            os.close(self._wfd)
            self._rfd = self._wfd = None
        while not self.events.empty():
            self.events.get_nowait().release()

    def _wake(self) -> None:
        try:
            os.write(self._wfd, b"!")
        except (OSError, TypeError):
            pass  # already woken (pipe full), or closed

    # --- forwarding thread: owns every socket of the node ------------------------------

    def _main(self) -> None:
        t = self.t
        self._ctx, self._coord, socks = zmq.Context(), None, []
        try:
            self._router = _socket(self._ctx, zmq.ROUTER, t)
            socks.append(self._router)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # learn that an upstream peer is gone
            bind = t.nodes[self.index].get("bind", self.endpoint)
            try:
                self._router.bind(bind)
            except zmq.ZMQError as e:
                raise TransportError(f"relay transport: node {self.id} cannot bind {bind}: {e}") from None
            self._local = _Link(LOCAL, self.id, self.endpoint, [self.id])
            self._links = []
            for c in t.children(self.index):
                socks.append(_dealer(self._ctx, t, f"relay:{self.id}", t.endpoint(c)))
                self._links.append(_Link(c, t.ids[c], t.endpoint(c), t.subtree(c), socks[-1]))
            if t.config.get("coordinator"):  # replies queue until the coordinator is there
                self._coord = _socket(self._ctx, zmq.PUSH, t, int(min(t.timeout_s, 5) * 1000))
                self._coord.connect(t.config["coordinator"])
            self._entries: dict[tuple, _Entry] = {}
            self._up: deque = deque()  # acks the router could not send yet (the peer's queue is full)
            self._to_local: deque = deque()  # events waiting for room in self.events
            self._started.set()
            self._loop()
        except Exception as e:  # noqa: BLE001 - reported by the constructor or by poll()
            self._error = e
            log.exception("relay %s stopped", self.id)
        finally:
            self._started.set()
            for s in socks:
                s.close(0)
            if self._coord is not None:
                self._coord.close()  # with its linger, so the last replies (e.g. 'verified') leave
            self._ctx.term()

    def _loop(self) -> None:
        poller = zmq.Poller()
        for s in [self._router, *(link.sock for link in self._links), self._rfd]:
            poller.register(s, zmq.POLLIN)
        while not self._stop:
            backlog = self._up or self._to_local or any(link.queue for link in self._links)
            ready = dict(poller.poll(20 if backlog else 100))
            if self._rfd in ready:
                try:
                    while os.read(self._rfd, 4096):
                        pass
                except BlockingIOError:
                    pass
            while not self._commands.empty():
                cmd = self._commands.get_nowait()
                if cmd[0] == "staged":
                    ok = cmd[2] is None
                    self._answer(self._local, cmd[1], int(ok), {} if ok else {self.id: str(cmd[2])}, {})
                else:
                    self._send_coordinator(cmd[1])
            if self._router in ready:
                self._read_router()
            for link in self._links:
                if link.sock in ready:
                    self._read_acks(link)
            self._pump()
            now = time.monotonic()
            for link in [self._local, *self._links]:
                if link.busy and now - link.last > self.timeout:
                    self._give_up(link)

    def _read_router(self) -> None:
        for _ in range(256):  # then let acks and timers have a turn
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident, head = frames[0].bytes, frames[1].bytes if len(frames) > 1 else b""
            try:
                msg = loads(head)
            except TransportError as e:
                log.warning("relay %s: dropped a message: %s", self.id, e)
                continue
            if msg["kind"] == "payload":
                self._on_payload(ident, head, msg, frames[2] if len(frames) == 3 else None)
            elif msg["kind"] == "manifest":
                self._deliver(Event("manifest", msg))
                for link in self._links:
                    if msg.get("transfer_id") not in link.dead:
                        link.touch()
                        link.queue.append(("m", head))
            else:  # control from the coordinator: begin / commit / abort / verify / shutdown
                self._deliver(Event(msg["kind"], msg))

    def _on_payload(self, ident: bytes, head: bytes, msg: dict, data) -> None:
        key = (msg.get("transfer_id"), msg.get("producer_id"), msg.get("payload_id"))
        entry = self._entries.get(key)
        if entry is not None:  # a retry while the first copy is still in the tree: ack both senders
            if ident not in entry.upstream:
                entry.upstream.append(ident)
            return
        if data is None or not all(isinstance(k, str) for k in key):
            why = f"malformed payload message at relay {self.id}"
            self._up.append([ident, dumps({"kind": "ack", "transfer_id": key[0], "producer_id": key[1],
                                           "payload_id": key[2], "staged": 0, "lost": {},
                                           "rejected": dict.fromkeys(self.t.subtree(self.index), why)})])
            return
        entry = self._entries[key] = _Entry(key, head, data, len(data), [ident])
        self.stats["payloads"] += 1
        self.stats["held_bytes"] += entry.size
        self.stats["peak_held_bytes"] = max(self.stats["peak_held_bytes"], self.stats["held_bytes"])
        for link in [self._local, *self._links]:
            if key[0] in link.dead:  # given up for this transfer: fail fast
                entry.lost.update(dict.fromkeys(link.subtree, link.dead[key[0]]))
                continue
            entry.waiting.add(link.index)
            link.touch()
            if link.sock is not None:
                link.queue.append(("p", key))  # sent by _pump as the child's window allows
            else:
                link.inflight[key] = entry.size
                link.inflight_bytes += entry.size
                view = memoryview(data)
                self._deliver(Event("payload", dict(msg), view, lambda v=view: _release(v)))
        self._maybe_done(entry)

    def _deliver(self, event: Event | None = None) -> None:
        """Hand events to poll() in arrival order, as far as its bounded queue has room."""
        if event is not None:
            self._to_local.append(event)
        while self._to_local:
            try:
                self.events.put_nowait(self._to_local[0])
            except queue.Full:
                self._overflow = True  # poll() wakes us when it takes one
                return
            self._to_local.popleft()
        self._overflow = False

    def _pump(self) -> None:
        """Send each child what its window allows, in arrival order."""
        t = self.t
        for link in self._links:
            while link.queue:
                kind, item = link.queue[0]
                if kind == "m":
                    frames = [item]
                else:
                    entry = self._entries.get(item)
                    if entry is None or link.index not in entry.waiting:
                        link.queue.popleft()
                        continue
                    if link.inflight and (link.inflight_bytes + entry.size > t.window_bytes
                                          or len(link.inflight) >= t.window_payloads):
                        break  # window full: wait for the child's acks
                    frames = [entry.head, entry.data]
                try:
                    link.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break  # not connected, or its high-water mark is reached
                link.queue.popleft()
                if kind == "p":
                    link.inflight[item] = entry.size
                    link.inflight_bytes += entry.size
                    self.stats["peak_link_bytes"] = max(self.stats["peak_link_bytes"], link.inflight_bytes)
        while self._up:  # acks to senders
            try:
                self._router.send_multipart(self._up[0], zmq.NOBLOCK)
            except zmq.Again:
                break  # the sender's queue is full; retried on the next turn
            except zmq.ZMQError as e:  # EHOSTUNREACH: the producer or parent went away
                log.info("relay %s: dropped an ack: %s", self.id, e)
            self._up.popleft()
        self._deliver()

    def _read_acks(self, link: _Link) -> None:
        for _ in range(256):
            try:
                msg = loads(link.sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            except TransportError as e:
                log.warning("relay %s: bad ack from %s: %s", self.id, link.id, e)
                continue
            if msg.get("kind") == "ack":
                key = (msg.get("transfer_id"), msg.get("producer_id"), msg.get("payload_id"))
                self._answer(link, key, int(msg.get("staged") or 0), msg.get("rejected") or {}, msg.get("lost") or {})

    def _answer(self, link: _Link, key: tuple, staged: int, rejected: dict, lost: dict) -> None:
        """A child's ack, or the local receiver's staged(), for one payload."""
        link.last = time.monotonic()
        size = link.inflight.pop(key, None)
        if size is None:
            return  # late (the link was given up for it) or a duplicate
        link.inflight_bytes -= size
        entry = self._entries.get(key)
        if entry is None or link.index not in entry.waiting:
            return
        entry.waiting.discard(link.index)
        entry.staged += staged
        entry.rejected.update(rejected)
        entry.lost.update(lost)
        self._maybe_done(entry)

    def _maybe_done(self, entry: _Entry) -> None:
        if entry.waiting:
            return
        del self._entries[entry.key]
        self.stats["held_bytes"] -= entry.size
        tid, prod, pid = entry.key
        ack = dumps({"kind": "ack", "transfer_id": tid, "producer_id": prod, "payload_id": pid,
                     "staged": entry.staged, "rejected": entry.rejected, "lost": entry.lost})
        self._up.extend([ident, ack] for ident in entry.upstream)

    def _give_up(self, link: _Link) -> None:
        """No progress on a busy link for its timeout: its subtree is lost for these transfers."""
        if link.index == LOCAL:
            why = f"receiver {self.id} at {self.endpoint} staged nothing for {self.timeout:.1f} s (its relay is up)"
        elif link.inflight:
            why = f"relay {link.id} at {link.endpoint} acknowledged nothing for {self.timeout:.1f} s"
        else:
            why = f"relay {link.id} at {link.endpoint} accepted nothing for {self.timeout:.1f} s (not running?)"
        keys = list(link.inflight) + [item for kind, item in link.queue if kind == "p"]
        link.inflight.clear()
        link.inflight_bytes = 0
        link.queue.clear()
        for key in keys:
            link.dead[key[0]] = why
            entry = self._entries.get(key)
            if entry is not None and link.index in entry.waiting:
                entry.waiting.discard(link.index)
                entry.lost.update(dict.fromkeys(link.subtree, why))
                self.stats["lost"] += 1
                self._maybe_done(entry)
        _trim(link.dead)
        log.warning("relay %s: %s", self.id, why)

    def _send_coordinator(self, msg: dict) -> None:
        try:
            if self._coord is None:
                raise zmq.Again()
            self._coord.send(dumps(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("relay %s: no coordinator takes replies at %s; dropped %s", self.id,
                        self.t.config.get("coordinator"), msg["kind"])


# --- coordinator -----------------------------------------------------------------------

class _Coordinator(CoordinatorEnd):
    """Talks to every node directly; collects replies on the `coordinator` endpoint."""

    def __init__(self, t: RelayTransport):
        self.t = t
        self.ctx = zmq.Context()
        self.inbox = _socket(self.ctx, zmq.PULL, t)
        bind = t.config.get("coordinator_bind", t.config["coordinator"])
        try:
            self.inbox.bind(bind)
        except zmq.ZMQError as e:
            self.inbox.close(0)
            self.ctx.term()
            raise TransportError(f"relay transport: the coordinator cannot bind {bind}: {e}") from None
        # Linger so a last broadcast (commit, shutdown) still leaves when we close right after it.
        self.out = [_dealer(self.ctx, t, "coordinator", t.endpoint(i), linger_ms=int(min(t.timeout_s, 2) * 1000))
                    for i in range(len(t.nodes))]

    def broadcast(self, kind, meta):
        raw = dumps({**meta, "kind": kind})
        pending = list(range(len(self.t.nodes)))
        deadline = time.monotonic() + self.t.timeout_s
        while True:
            left = []
            for i in pending:
                try:
                    self.out[i].send(raw, zmq.NOBLOCK)
                except zmq.Again:
                    left.append(i)  # not connected (yet) or its queue is full
            pending = left
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TransportError(f"relay transport: {'; '.join(self.t.who(i) for i in pending)} did not accept "
                                     f"'{kind}' within {self.t.timeout_s:.0f} s")
            time.sleep(0.01)

    def collect(self, kind, transfer_id, timeout_s):
        replies: dict[str, dict] = {}
        replies_from = set(self.t.receivers)
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(self.t.receivers):
            left = deadline - time.monotonic()
            if left <= 0 or not self.inbox.poll(int(left * 1000)):
                missing = sorted(set(self.t.receivers) - set(replies))
                where = ", ".join(f"{r} at {self.t.endpoint(self.t.index(r))}" for r in missing)
                raise TransportError(f"relay transport: receivers {missing} sent no '{kind}' for transfer "
                                     f"{transfer_id} within {timeout_s:.0f} s ({where})")
            try:
                msg = loads(self.inbox.recv())
            except TransportError as e:
                log.warning("coordinator: %s", e)
                continue
            if msg["kind"] == kind and msg.get("transfer_id") == transfer_id and msg.get("receiver") in replies_from:
                replies[msg["receiver"]] = msg
        return replies

    def close(self):
        self.inbox.close(0)
        for s in self.out:
            s.close()
        self.ctx.term()
