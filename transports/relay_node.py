"""The forwarding engine of one relay-tree node (the transport and its ends are in `relay`).

A RelayNode is one background thread that owns every socket of its node: the ROUTER that
producers, the parent and the coordinator send to, a DEALER per child, and a PUSH to the
coordinator. It hands each payload to the local receiver end through a bounded queue,
forwards the same zmq frame (no copy) to each child as that child's window allows, and
acks the payload to its senders once the local receiver and every child answered, with
the subtree's outcome (staged count, rejections, losses). A busy link (child or local
receiver) that makes no progress for the node's link timeout is given up: its subtree is
lost for that transfer. Other threads reach the engine only through its methods
(`next_event`, `staged`, `reply`, `close`): a command queue, and a pipe that wakes the
thread's poller.

Also here: the socket helpers every relay end uses.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from nemo_dcr.errors import TransportError
from nemo_dcr.transport import Event, dumps, loads

if TYPE_CHECKING:
    from nemo_dcr.transports.relay import RelayTransport

log = logging.getLogger("nemo_dcr.transports.relay")  # one logger for the whole relay transport

LOCAL = -1  # the local receiver's slot in an entry's `waiting` set (children use their node index)


def zsocket(ctx: zmq.Context, kind: int, t: RelayTransport, linger_ms: int = 0, *, server: bool = False
            ) -> zmq.Socket:
    """A socket of `kind` with the transport's high-water marks and, when the transport has
    a CURVE key, encryption and authentication (`server`: the side that binds)."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, linger_ms)
    s.setsockopt(zmq.SNDHWM, t.hwm)
    s.setsockopt(zmq.RCVHWM, t.hwm)
    if t.curve is not None:
        public, secret = t.curve
        s.curve_publickey, s.curve_secretkey = public, secret
        if server:
            s.curve_server = True
        else:
            s.curve_serverkey = public
    return s


class _SharedKeyOnly:
    """ZAP policy: a CURVE client is let in only if it holds the deployment's key pair."""

    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


def bind_server(ctx: zmq.Context, sock: zmq.Socket, t: RelayTransport, endpoint: str, who: str):
    """Bind `sock`; with CURVE start this context's authenticator first (returned, to stop
    on close), without it warn when the endpoint is reachable from the network."""
    auth = None
    if t.curve is not None:
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=_SharedKeyOnly(t.curve[0]))
    elif not is_loopback(endpoint):
        msg = (f"relay transport: {who} binds {endpoint} WITHOUT authentication or encryption: anyone who "
               f"reaches it can read payloads and send control messages; set 'curve_secret_env'")
        log.warning(msg)
        warnings.warn(msg, stacklevel=3)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:
        if auth is not None:
            auth.stop()
        raise
    return auth


def is_loopback(endpoint: str) -> bool:
    """True for tcp endpoints on a loopback address (reachable from this machine only)."""
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def dealer(ctx: zmq.Context, t: RelayTransport, role: str, endpoint: str, linger_ms: int = 0) -> zmq.Socket:
    """A DEALER connected to `endpoint`, with a routing id that names its `role`."""
    s = zsocket(ctx, zmq.DEALER, t, linger_ms)
    s.setsockopt(zmq.ROUTING_ID, f"{role}:{uuid.uuid4().hex[:12]}".encode())
    s.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer that is not connected
    s.connect(endpoint)
    return s


def _release(view: memoryview) -> None:
    try:
        view.release()
    except BufferError:  # a consumer still holds a view; freed with the last reference
        pass


def trim(d: dict, keep: int = 64) -> None:
    """Forget all but the `keep` newest entries of `d`."""
    while len(d) > keep:
        d.pop(next(iter(d)))


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


class RelayNode:
    """The forwarding thread of node `receiver_id`; raises what stopped it from starting."""

    def __init__(self, t: RelayTransport, receiver_id: str):
        self.t, self.id = t, receiver_id
        self.index = t.index(receiver_id)
        self.endpoint = t.endpoint(self.index)
        self.timeout = t.link_timeout(self.index)
        self.events: queue.Queue = queue.Queue(maxsize=t.local_queue)  # bounded hand-off to next_event()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # staged()/reply() -> forwarding thread
        self._rfd, self._wfd = os.pipe()  # wakes the forwarding thread's poller
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._stop, self._overflow = False, False
        self.error: Exception | None = None  # what stopped the forwarding thread
        self.stats = {"payloads": 0, "held_bytes": 0, "peak_held_bytes": 0, "peak_link_bytes": 0, "lost": 0}
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"relay-{receiver_id}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self.error is not None:
            self.close()
            raise self.error

    # --- called from other threads (the local receiver's) -------------------------------

    def next_event(self, timeout_s: float) -> Event | None:
        """The next event for the local receiver, or None after timeout_s."""
        try:
            event = self.events.get(timeout=max(timeout_s, 0))
        except queue.Empty:
            return None
        if self._overflow:
            self._wake()  # room in the queue again: let the forwarding thread refill it
        return event

    def staged(self, key: tuple[str, str, str], error: str | None) -> None:
        """The local receiver's answer for payload `key` (transfer, producer, payload)."""
        self._commands.put(("staged", key, error))
        self._wake()

    def reply(self, msg: dict) -> None:
        """Send `msg` to the coordinator."""
        self._commands.put(("reply", msg))
        self._wake()

    def close(self) -> None:
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
        self._ctx, self._coord, socks, auth = zmq.Context(), None, [], None
        try:
            self._router = zsocket(self._ctx, zmq.ROUTER, t, server=True)
            socks.append(self._router)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # learn that an upstream peer is gone
            bind = t.nodes[self.index].get("bind", self.endpoint)
            try:
                auth = bind_server(self._ctx, self._router, t, bind, f"node {self.id}")
            except zmq.ZMQError as e:
                raise TransportError(f"relay transport: node {self.id} cannot bind {bind}: {e}") from None
            self._local = _Link(LOCAL, self.id, self.endpoint, [self.id])
            self._links = []
            for c in t.children(self.index):
                socks.append(dealer(self._ctx, t, f"relay:{self.id}", t.endpoint(c)))
                self._links.append(_Link(c, t.ids[c], t.endpoint(c), t.subtree(c), socks[-1]))
            if t.config.get("coordinator"):  # replies queue until the coordinator is there
                self._coord = zsocket(self._ctx, zmq.PUSH, t, int(min(t.timeout_s, 5) * 1000))
                self._coord.connect(t.config["coordinator"])
            self._entries: dict[tuple, _Entry] = {}
            self._up: deque = deque()  # acks the router could not send yet (the peer's queue is full)
            self._to_local: deque = deque()  # events waiting for room in self.events
            self._started.set()
            self._loop()
        except Exception as e:  # noqa: BLE001 - reported by the constructor or by poll()
            self.error = e
            log.exception("relay %s stopped", self.id)
        finally:
            self._started.set()
            for s in socks:
                s.close(0)
            if self._coord is not None:
                self._coord.close()  # with its linger, so the last replies (e.g. 'verified') leave
            if auth is not None:
                auth.stop()
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
        trim(link.dead)
        log.warning("relay %s: %s", self.id, why)

    def _send_coordinator(self, msg: dict) -> None:
        try:
            if self._coord is None:
                raise zmq.Again()
            self._coord.send(dumps(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("relay %s: no coordinator takes replies at %s; dropped %s", self.id,
                        self.t.config.get("coordinator"), msg["kind"])
