"""The forwarding engine of one relay-tree node (the transport and its ends are in `relay`).

A RelayNode is one background thread that owns every socket of its node: the ROUTER that
producers, the parent and the coordinator send to, the links down the tree (a `Fanout`),
and a PUSH to the coordinator. It hands each payload to the local receiver end through a
bounded queue, forwards the same zmq frame (no copy) down each link as that link's window
allows, and acks the payload to its senders once the local receiver and every link
answered, with the subtree's outcome (staged count, rejections, losses). Other threads
reach the engine only through its methods (`next_event`, `staged`, `reply`, `close`): a
command queue, and a pipe that wakes the thread's poller.

A `Fanout` is the set of links from one sender down the tree, and their repair; a relay
uses one for its children, a producer one for the root. Every link is a DEALER with a
socket monitor (is the peer connected?) and ZMTP heartbeats (a peer silent for
3 * heartbeat_s, e.g. a host that vanished without closing its connections, is
disconnected). A busy link that makes no progress is given up, in one of two ways:
  - dead: not connected for the grace, min(reconnect_s, link timeout / 2) (the process or
    its host is gone; a restarted one would have reconnected). The sender adopts the dead
    node's children for the transfers it was carrying: it connects to them and re-sends
    everything the dead node had not acknowledged, with those transfers' manifests, so
    the subtree still gets every payload; only the dead node is lost. Recursive: a dead
    adoptee's children are adopted in turn.
  - hung: connected, but nothing acknowledged (or accepted) for the link timeout. Its
    whole subtree is lost for that transfer. A connected peer may be slow rather than
    stuck, and re-sending its window to its children behind its back would double the
    traffic into a subtree that is likely congested already: the tree is repaired around
    nodes known to be gone, and a live but stuck node is reported with what is behind it.
A disconnect re-queues what the link had in flight (frames in a dropped connection are
gone), and so does the next handshake (a send just after the drop may have gone with it);
a peer back within the grace gets them again. Only the socket monitor's events say whether
a link is connected. Decisions are per transfer: the next
transfer tries the original link again, so a restarted node (same endpoint) rejoins; a
link opened to an adoptee is closed once it has been idle for the link timeout and the
node it stood in for is connected again. Delivery stays at least once: an adoptee may get
a payload the dead node had already forwarded (receivers dedup by id).

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
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from nemo_dcr.errors import TransportError
from nemo_dcr.transport import Event, Transport, dumps, loads

# Every `t: Transport` below is the `RelayTransport` (transports/relay.py) the end belongs
# to; annotated by its base class because that module imports this one.

log = logging.getLogger("nemo_dcr.transports.relay")  # one logger for the whole relay transport

LOCAL = -1  # the local receiver's slot in an entry's `waiting` set (links use their node index)


def zsocket(ctx: zmq.Context, kind: int, t: Transport, linger_ms: int = 0, *, server: bool = False
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


def bind_server(ctx: zmq.Context, sock: zmq.Socket, t: Transport, endpoint: str, who: str):
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


def dealer(ctx: zmq.Context, t: Transport, role: str, endpoint: str | None, linger_ms: int = 0) -> zmq.Socket:
    """A DEALER with a routing id that names its `role`, connected to `endpoint` (None: not
    yet, so that a monitor can be attached first)."""
    s = zsocket(ctx, zmq.DEALER, t, linger_ms)
    s.setsockopt(zmq.ROUTING_ID, f"{role}:{uuid.uuid4().hex[:12]}".encode())
    s.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer that is not connected
    if endpoint is not None:
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
class Entry:
    """A payload a sender holds until every link it went down (and the local receiver) answered."""

    key: tuple[str, str, str]  # (transfer, producer, payload)
    head: bytes  # the JSON header frame, forwarded unchanged
    data: object  # zmq.Frame (shared, not copied, by the local event and every link's send) or bytes
    size: int
    upstream: list[bytes]  # routing ids (producer or parent) to acknowledge
    waiting: set = field(default_factory=set)  # link indexes still to answer
    staged: int = 0
    rejected: dict = field(default_factory=dict)
    lost: dict = field(default_factory=dict)
    handed: bool = False  # sent down at least one link (a producer's send waits for it)


@dataclass
class _Link:
    """A link down the tree (a DEALER to node `index`), or, with index LOCAL and no socket,
    the local receiver."""

    index: int
    id: str
    endpoint: str
    sock: zmq.Socket | None = None
    monitor: zmq.Socket | None = None  # connection events of `sock`
    adopted: bool = False  # opened to stand in for a failed node above it
    queue: deque = field(default_factory=deque)  # ("p", key) | ("m", (transfer, manifest frame)), in order
    inflight: dict = field(default_factory=dict)  # key -> size: sent, not yet answered
    inflight_bytes: int = 0
    last: float = 0.0  # last progress: an answer, a connection change, or the moment the link became busy
    connected: bool = False  # the ZMTP handshake with the peer succeeded and it has not disconnected since
    was_connected: bool = False
    dead: dict = field(default_factory=dict)  # LOCAL only: transfer -> why the receiver was given up for it

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.inflight)

    def touch(self) -> None:
        if not self.busy:
            self.last = time.monotonic()


class Fanout:
    """The links from one sender down the tree, and their repair (see the module docstring).

    `roots` are the nodes the sender sends to (a relay's children, or [0] for a producer);
    `entries` the sender's held payloads by key, shared with it; `done(entry)` is called
    whenever an entry's `waiting` shrank (it acts once it is empty); `missed(transfer,
    {receiver: why})` when receivers will not get a manifest. Used from one thread only.
    """

    def __init__(self, t: Transport, ctx: zmq.Context, poller: zmq.Poller, role: str, roots: list[int],
                 timeout: float, entries: dict, done: Callable, stats: dict, *, window_bytes: int,
                 window_payloads: int, missed: Callable | None = None):
        self.t, self.ctx, self.poller, self.role = t, ctx, poller, role
        self.roots, self.timeout = list(roots), timeout
        # How long a busy link may stay disconnected; at most half the sender's own timeout,
        # so that its stand-ins have the other half to answer before its sender gives up.
        self.grace = min(t.reconnect_s, timeout / 2)
        self.entries, self.done, self.stats, self.missed = entries, done, stats, missed
        self.window_bytes, self.window_payloads = window_bytes, window_payloads
        self.links: dict[int, _Link] = {}
        self.failed: dict[str, dict[int, tuple[str, bool]]] = {}  # transfer -> node -> (why, adopt its children)
        self.manifests: dict[str, list[bytes]] = {}  # recent transfers' manifest frames, re-sent on repair
        for r in self.roots:
            self._open(r)

    # --- routing -------------------------------------------------------------------------

    def resolve(self, transfer: str, i: int) -> tuple[list[int], dict[str, str]]:
        """Where a payload of `transfer` meant for node i goes: (links, {receiver: why lost})."""
        why, adopt = self.failed.get(transfer, {}).get(i, (None, False))
        if why is None:
            self._open(i)
            return [i], {}
        if not adopt:  # hung: whatever is behind it is lost with it
            return [], dict.fromkeys(self.t.subtree(i), why)
        targets, lost = [], {self.t.ids[i]: why}
        for c in self.t.children(i):
            more, gone = self.resolve(transfer, c)
            targets += more
            lost.update(gone)
        return targets, lost

    def add(self, entry: Entry) -> None:
        """Send `entry` down every link (queued; `pump` sends)."""
        for r in self.roots:
            targets, lost = self.resolve(entry.key[0], r)
            entry.lost.update(lost)
            for i in targets:
                self._queue(self.links[i], entry)

    def manifest(self, transfer: str, head: bytes) -> None:
        """Send a manifest down every link; remembered, to re-send where the tree is repaired."""
        self.manifests.setdefault(transfer, []).append(head)
        trim(self.manifests, 2)  # the transfer under way and the one before: they hold every payload id
        for r in self.roots:
            targets, _ = self.resolve(transfer, r)
            for i in targets:
                self.links[i].touch()
                self.links[i].queue.append(("m", (transfer, head)))

    def holds_manifest(self, transfer: str) -> bool:
        return any(kind == "m" and item[0] == transfer for link in self.links.values() for kind, item in link.queue)

    @property
    def backlog(self) -> bool:
        return any(link.queue for link in self.links.values())

    def _queue(self, link: _Link, entry: Entry) -> None:
        entry.waiting.add(link.index)
        link.touch()
        link.queue.append(("p", entry.key))

    # --- sockets -------------------------------------------------------------------------

    def _open(self, i: int) -> _Link:
        link = self.links.get(i)
        if link is not None:
            return link
        t = self.t
        sock = dealer(self.ctx, t, self.role, None)
        if t.heartbeat_s:  # a peer whose host vanished (no FIN) is disconnected after 3 heartbeats
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(t.heartbeat_s * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * t.heartbeat_s * 1000))
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED,
                                          f"inproc://relay-monitor-{uuid.uuid4().hex}")
        sock.connect(t.endpoint(i))  # after the monitor: the first handshake is an event too
        link = self.links[i] = _Link(i, t.ids[i], t.endpoint(i), sock, monitor, adopted=i not in self.roots,
                                     last=time.monotonic())
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)
        return link

    def _close(self, link: _Link) -> None:
        del self.links[link.index]
        for s in (link.monitor, link.sock):
            self.poller.unregister(s)
        link.sock.disable_monitor()
        link.monitor.close(0)
        link.sock.close(0)

    def close(self) -> None:
        for link in list(self.links.values()):
            self._close(link)

    def reset(self) -> None:
        """Forget everything queued and in flight (a producer whose transfer failed)."""
        for link in self.links.values():
            link.queue.clear()
            link.inflight.clear()
            link.inflight_bytes = 0

    # --- the sender's turn: send, read, time out ------------------------------------------

    def pump(self) -> None:
        """Send each link what its window allows, in arrival order."""
        for link in self.links.values():
            while link.queue:
                kind, item = link.queue[0]
                entry = None
                if kind == "m":
                    frames = [item[1]]
                else:
                    entry = self.entries.get(item)
                    if entry is None or link.index not in entry.waiting:
                        link.queue.popleft()  # answered or given up meanwhile
                        continue
                    if link.inflight and (link.inflight_bytes + entry.size > self.window_bytes
                                          or len(link.inflight) >= self.window_payloads):
                        break  # window full: wait for the peer's acks
                    frames = [entry.head, entry.data]
                try:
                    link.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break  # not connected, or its high-water mark is reached
                link.queue.popleft()  # taken; but not proof of a live connection (see _read_events)
                if entry is not None:
                    entry.handed = True
                    link.inflight[item] = entry.size
                    link.inflight_bytes += entry.size
                    self.stats["peak_link_bytes"] = max(self.stats["peak_link_bytes"], link.inflight_bytes)

    def handle(self, ready: dict) -> None:
        """Read the acks and connection events of the links that are ready."""
        for link in list(self.links.values()):
            if link.sock in ready:
                self._read_acks(link)
            if link.monitor in ready:
                self._read_events(link)

    def _read_acks(self, link: _Link) -> None:
        for _ in range(256):  # then let the others have a turn
            try:
                msg = loads(link.sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            except TransportError as e:
                log.warning("%s: bad ack from %s: %s", self.role, link.id, e)
                continue
            if msg.get("kind") == "ack":
                key = (msg.get("transfer_id"), msg.get("producer_id"), msg.get("payload_id"))
                self.answer(link, key, int(msg.get("staged") or 0), msg.get("rejected") or {}, msg.get("lost") or {})

    def _read_events(self, link: _Link) -> None:
        while True:
            try:
                event = recv_monitor_message(link.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            # Only these events set `connected`, never a send that went through: the IO thread
            # reports a drop before it detaches the dropped connection's pipe, so a send right
            # after the DISCONNECTED event can still be taken by that pipe and vanish.
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if link.was_connected and not link.connected:
                    self._requeue(link)  # back: what was sent while it was away may be gone
                link.connected = link.was_connected = True
                link.last = time.monotonic()
            elif event == zmq.EVENT_DISCONNECTED and link.connected:
                link.connected = False
                link.last = time.monotonic()  # the grace to come back starts now
                self._requeue(link)

    def _requeue(self, link: _Link) -> None:
        """The connection dropped, and what was in it: send it again (to the peer if it is
        back within the grace, else to the nodes that stand in for it)."""
        keys = list(link.inflight)
        link.inflight.clear()
        link.inflight_bytes = 0
        link.queue.extendleft(("p", k) for k in reversed(keys))
        for transfer in dict.fromkeys(k[0] for k in keys):
            link.queue.extend(("m", (transfer, head)) for head in self.manifests.get(transfer, []))
        self.stats["resent"] += len(keys)
        if keys:
            log.info("%s: lost the connection to %s with %d payload(s) unacknowledged; re-sending",
                     self.role, self.t.who(link.index), len(keys))

    def answer(self, link: _Link, key: tuple, staged: int, rejected: dict, lost: dict) -> None:
        """A link's ack (or the local receiver's staged()) for one payload."""
        link.last = time.monotonic()
        size = link.inflight.pop(key, None)
        if size is not None:
            link.inflight_bytes -= size
        entry = self.entries.get(key)
        if entry is None or link.index not in entry.waiting:
            return  # late (given up for it) or a duplicate
        entry.waiting.discard(link.index)
        entry.staged += staged
        entry.rejected.update(rejected)
        entry.lost.update(lost)
        self.done(entry)

    def check(self, now: float) -> None:
        """Give up busy links without progress; close stand-in links no longer needed."""
        for link in list(self.links.values()):
            if link.busy:
                if not link.connected:
                    self._read_events(link)  # a handshake may have landed since the last poll
                if link.busy and now - link.last > (self.timeout if link.connected else self.grace):
                    self.give_up(link)
            elif link.adopted and now - link.last > self.timeout and self._stood_in_for(link).connected:
                self._close(link)  # idle for a while (not just between two payloads), and not needed

    def _stood_in_for(self, link: _Link) -> _Link:
        """The link of the sender's own root above an adopted link."""
        i = link.index
        while i not in self.roots:
            i = self.t.parent(i)
        return self.links[i]

    def give_up(self, link: _Link) -> None:
        """No progress on a busy link: adopt its children if it is dead, lose its subtree if hung."""
        who, adopt = self.t.who(link.index), not link.connected
        if adopt and link.was_connected:
            why = f"{who} lost its connection and did not reconnect within {self.grace:.1f} s (process or host down?)"
        elif adopt:
            why = f"{who} did not accept a connection within {self.grace:.1f} s (not running or unreachable)"
        elif link.inflight:
            why = f"{who} acknowledged nothing for {self.timeout:.1f} s (hung?)"
        else:
            why = f"{who} accepted nothing for {self.timeout:.1f} s (hung?)"
        keys = list(link.inflight) + [item for kind, item in link.queue if kind == "p"]
        transfers = dict.fromkeys([k[0] for k in keys] + [item[0] for kind, item in link.queue if kind == "m"])
        link.inflight.clear()
        link.inflight_bytes = 0
        link.queue.clear()
        link.last = time.monotonic()
        for transfer in transfers:
            self.failed.setdefault(transfer, {})[link.index] = (why, adopt)
        trim(self.failed)
        for key in keys:
            entry = self.entries.get(key)
            if entry is None or link.index not in entry.waiting:
                continue
            entry.waiting.discard(link.index)
            targets, lost = self.resolve(key[0], link.index)
            entry.lost.update(lost)
            self.stats["lost"] += 1
            self.stats["resent"] += len(targets)
            for i in targets:
                self._queue(self.links[i], entry)
            self.done(entry)
        for transfer in transfers:  # the manifests may have died with it
            targets, lost = self.resolve(transfer, link.index)
            for i in targets:
                self.links[i].queue.extend(("m", (transfer, head)) for head in self.manifests.get(transfer, []))
            if self.missed is not None:
                self.missed(transfer, lost)
        if adopt:
            self.stats["adopted"] += 1
            log.warning("%s: %s; its children are served directly for %d transfer(s)", self.role, why, len(transfers))
        else:
            log.warning("%s: %s; its subtree is lost for %d transfer(s)", self.role, why, len(transfers))


class RelayNode:
    """The forwarding thread of node `receiver_id`; raises what stopped it from starting."""

    def __init__(self, t: Transport, receiver_id: str):
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
        self.stats = {"payloads": 0, "held_bytes": 0, "peak_held_bytes": 0, "peak_link_bytes": 0, "lost": 0,
                      "adopted": 0, "resent": 0}
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
        self._ctx, self._coord, self._fanout, auth = zmq.Context(), None, None, None
        self._router = None
        try:
            self._router = zsocket(self._ctx, zmq.ROUTER, t, server=True)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # learn that an upstream peer is gone
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a sender that reconnects gets its acks at once
            bind = t.nodes[self.index].get("bind", self.endpoint)
            try:
                auth = bind_server(self._ctx, self._router, t, bind, f"node {self.id}")
            except zmq.ZMQError as e:
                raise TransportError(f"relay transport: node {self.id} cannot bind {bind}: {e}") from None
            self._poller = zmq.Poller()
            self._poller.register(self._router, zmq.POLLIN)
            self._poller.register(self._rfd, zmq.POLLIN)
            self._local = _Link(LOCAL, self.id, self.endpoint)
            self._entries: dict[tuple, Entry] = {}
            self._fanout = Fanout(t, self._ctx, self._poller, f"relay:{self.id}", t.children(self.index),
                                  self.timeout, self._entries, self._maybe_done, self.stats,
                                  window_bytes=t.window_bytes, window_payloads=t.window_payloads)
            if t.config.get("coordinator"):  # replies queue until the coordinator is there
                self._coord = zsocket(self._ctx, zmq.PUSH, t, int(min(t.timeout_s, 5) * 1000))
                self._coord.connect(t.config["coordinator"])
            self._up: deque = deque()  # acks the router could not send yet (the peer's queue is full)
            self._to_local: deque = deque()  # events waiting for room in self.events
            self._started.set()
            self._loop()
        except Exception as e:  # noqa: BLE001 - reported by the constructor or by poll()
            self.error = e
            log.exception("relay %s stopped", self.id)
        finally:
            self._started.set()
            if self._fanout is not None:
                self._fanout.close()
            if self._router is not None:
                self._router.close(0)
            if self._coord is not None:
                self._coord.close()  # with its linger, so the last replies (e.g. 'verified') leave
            if auth is not None:
                auth.stop()
            self._ctx.term()

    def _loop(self) -> None:
        while not self._stop:
            backlog = self._up or self._to_local or self._fanout.backlog
            ready = dict(self._poller.poll(20 if backlog else 100))
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
                    self._fanout.answer(self._local, cmd[1], int(ok), {} if ok else {self.id: str(cmd[2])}, {})
                else:
                    self._send_coordinator(cmd[1])
            if self._router in ready:
                self._read_router()
            self._fanout.handle(ready)
            self._pump()
            now = time.monotonic()
            if self._local.busy and now - self._local.last > self.timeout:
                self._give_up_local()
            self._fanout.check(now)

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
                if isinstance(msg.get("transfer_id"), str):
                    self._fanout.manifest(msg["transfer_id"], head)
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
        entry = self._entries[key] = Entry(key, head, data, len(data), [ident])
        self.stats["payloads"] += 1
        self.stats["held_bytes"] += entry.size
        self.stats["peak_held_bytes"] = max(self.stats["peak_held_bytes"], self.stats["held_bytes"])
        if key[0] in self._local.dead:  # the local receiver was given up for this transfer: fail fast
            entry.lost[self.id] = self._local.dead[key[0]]
        else:
            entry.waiting.add(LOCAL)
            self._local.touch()
            self._local.inflight[key] = entry.size
            self._local.inflight_bytes += entry.size
            view = memoryview(data)
            self._deliver(Event("payload", dict(msg), view, lambda v=view: _release(v)))
        self._fanout.add(entry)  # queued for each link; sent by _pump as the windows allow
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
        """Send down the links what their windows allow, acks to senders, events to poll()."""
        self._fanout.pump()
        while self._up:  # acks to senders
            try:
                self._router.send_multipart(self._up[0], zmq.NOBLOCK)
            except zmq.Again:
                break  # the sender's queue is full; retried on the next turn
            except zmq.ZMQError as e:  # EHOSTUNREACH: the producer or parent went away
                log.info("relay %s: dropped an ack: %s", self.id, e)
            self._up.popleft()
        self._deliver()

    def _maybe_done(self, entry: Entry) -> None:
        if entry.waiting or self._entries.get(entry.key) is not entry:
            return
        del self._entries[entry.key]
        self.stats["held_bytes"] -= entry.size
        tid, prod, pid = entry.key
        ack = dumps({"kind": "ack", "transfer_id": tid, "producer_id": prod, "payload_id": pid,
                     "staged": entry.staged, "rejected": entry.rejected, "lost": entry.lost})
        self._up.extend([ident, ack] for ident in entry.upstream)

    def _give_up_local(self) -> None:
        """The local receiver staged nothing for the timeout: it is lost for these transfers."""
        link = self._local
        why = f"receiver {self.id} at {self.endpoint} staged nothing for {self.timeout:.1f} s (its relay is up)"
        keys = list(link.inflight)
        link.inflight.clear()
        link.inflight_bytes = 0
        for key in keys:
            link.dead[key[0]] = why
            entry = self._entries.get(key)
            if entry is not None and LOCAL in entry.waiting:
                entry.waiting.discard(LOCAL)
                entry.lost[self.id] = why
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
