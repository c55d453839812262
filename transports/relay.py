"""Relay-tree transport: each producer sends a payload once, to the root relay of the
rollout cluster, and the relays fan it out.

Topology: `nodes` is an ordered list of {"id": receiver_id, "endpoint": "tcp://host:port"}
(optional "bind", default the endpoint); node 0 is the root, the children of node i are
nodes fanout*i+1 .. fanout*i+fanout (`fanout`, default 2).

The relay is the receiver end: `receiver(rx_id)` binds the node's ROUTER and starts one
thread that owns all the node's sockets (`relay_node.RelayNode`, the forwarding engine).
It hands each payload to the local Receiver through a bounded queue (`poll()`),
forwards the same zmq frame (no copy) to each child, and acks it to its sender
(producer or parent) only once the local Receiver `staged()` it and every child acked
it. Acks carry the subtree's outcome (how many staged, who rejected and why, who was
lost and why), so the root's ack means "staged on every node" and `flush` returns
per-receiver rejections like the local transport.

Back-pressure: a relay sends a child at most `window_bytes` / `window_payloads` unacked;
it holds at most what its sender's window lets through (a producer's: max_in_flight_bytes).
A slow node stalls its parent's window, then the parent's acks, up to the producer's
`send`. ZeroMQ high-water marks (`hwm`) bound the socket queues too.

Control: the coordinator talks to every node directly (so a failed interior relay hides
no one and every silent node is named); nodes reply to its `coordinator` endpoint.
Manifests go down the tree with the data.

Failures and repair (the mechanics are in `relay_node`): every link down the tree, the
producer's to the root included, is watched (ZMTP handshake and disconnect events;
heartbeats every heartbeat_s). A busy link is given up when
  - its peer is dead: not connected for min(reconnect_s, half the link's timeout). The
    sender adopts the dead node's children: it connects to them and re-sends whatever
    the dead node had not acknowledged, with the transfer's manifests, so every other
    receiver still stages every payload. Only the dead node is lost. A dead root is the
    producers' to repair: they fall back to its children the same way, which is why a
    producer keeps a reference to each payload's bytes (not a copy; do not modify them)
    until every receiver staged it.
  - its peer is hung: connected, but no progress for timeout_s * (height + 1 - depth) /
    (height + 2) (timeout_s for a producer's link). Its subtree is lost for that
    transfer; deeper links give up first, so the node nearest the cause is named.
Losses travel up in the acks. A producer's `flush` waits until every payload is staged
or lost everywhere, then raises a TransportError naming the lost receivers and why
(`.lost`: receiver -> payload ids, `.rejected` as flush would return it); it raises at
once when a payload reached no receiver at all. A transfer with a lost receiver cannot
commit (the coordinator names it too); the next transfer tries every node again, so a
restarted node (same id and endpoint) rejoins, and a deployment can drop a node for good
by omitting it from `nodes` everywhere. Delivery is at least once: a re-sent payload still
in the tree is merged (each sender acked), later it travels again (receivers dedup by id).
Payloads travel as raw frames, control as JSON; nothing is pickled.

Security: with `curve_secret_env` (the name of an environment variable holding a Z85
CURVE secret key, made by `nemo-dcr curve-keygen`) every socket is encrypted and
authenticated with ZeroMQ CURVE: nodes and the coordinator accept only peers that hold
the same key pair, so nobody without the secret can read payloads or inject control
messages. Without it, binding an endpoint that is not on loopback logs a warning.

Configuration: nodes, fanout (2), coordinator (tcp endpoint), coordinator_bind,
timeout_s (120), reconnect_s (1), heartbeat_s (5; 0: off), max_in_flight_bytes (256 MiB,
per producer), window_bytes (64 MiB) and window_payloads (256) per link, hwm (1024),
local_queue (64), curve_secret_env (none).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

import zmq

from nemo_dcr.errors import TransportError
from nemo_dcr.transport import CoordinatorEnd, ProducerEnd, ReceiverEnd, Transport, dumps, loads
from nemo_dcr.transports.relay_node import Entry, Fanout, RelayNode, bind_server, dealer, trim, zsocket

log = logging.getLogger(__name__)

MANIFEST = "(manifest)"  # stands for the manifest where a producer records what a receiver did not get

DEFAULTS = {"fanout": 2, "timeout_s": 120.0, "reconnect_s": 1.0, "heartbeat_s": 5.0,
            "max_in_flight_bytes": 256 << 20, "window_bytes": 64 << 20, "window_payloads": 256, "hwm": 1024,
            "local_queue": 64}


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
        for key in ("fanout", "timeout_s", "reconnect_s", "max_in_flight_bytes", "window_bytes", "window_payloads",
                    "hwm", "local_queue"):
            if not float(cfg[key]) > 0:
                raise ValueError(f"relay transport: {key} must be > 0, got {cfg[key]!r}")
        if not float(cfg["heartbeat_s"]) >= 0:
            raise ValueError(f"relay transport: heartbeat_s must be >= 0 (0: none), got {cfg['heartbeat_s']!r}")
        self.fanout, self.timeout_s = int(cfg["fanout"]), float(cfg["timeout_s"])
        self.reconnect_s, self.heartbeat_s = float(cfg["reconnect_s"]), float(cfg["heartbeat_s"])
        self.max_in_flight = int(cfg["max_in_flight_bytes"])
        self.window_bytes, self.window_payloads = int(cfg["window_bytes"]), int(cfg["window_payloads"])
        self.hwm, self.local_queue = int(cfg["hwm"]), int(cfg["local_queue"])
        self.height = self.depth(len(self.nodes) - 1)
        self.curve = curve_keys(cfg.get("curve_secret_env"))

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
        return _Receiver(self, receiver_id)

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


def curve_keys(env_var: str | None) -> tuple[bytes, bytes] | None:
    """(public, secret) Z85 CURVE keys from the secret in `env_var`; None without one."""
    if env_var is None:
        return None
    if not zmq.has("curve"):
        raise ValueError("relay transport: curve_secret_env is set but this libzmq has no CURVE support")
    secret = os.environ.get(str(env_var), "").strip().encode()
    if len(secret) != 40:
        raise ValueError(f"relay transport: environment variable {env_var} must hold a 40-character Z85 CURVE "
                         f"secret key (make one with `nemo-dcr curve-keygen`); it is "
                         f"{'unset' if not secret else f'{len(secret)} characters long'}")
    try:
        return zmq.curve_public(secret), secret
    except zmq.ZMQError as e:
        raise ValueError(f"relay transport: {env_var} does not hold a valid Z85 CURVE secret key: {e}") from None


# --- producer --------------------------------------------------------------------------

class _Producer(ProducerEnd):
    """Sends each payload once, to the root (while the root is dead, to its children), and
    keeps it until every receiver staged it or was lost, to re-send it where the tree is
    repaired. Its links are a `Fanout` with the root as the only root, driven from the
    calling thread (`_turn`)."""

    def __init__(self, t: RelayTransport, producer_id: str):
        self.t, self.id = t, producer_id
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.entries: dict[tuple[str, str, str], Entry] = {}
        self.stats = {"peak_link_bytes": 0, "lost": 0, "adopted": 0, "resent": 0}
        self.links = Fanout(t, self.ctx, self.poller, f"producer:{producer_id}", [0], t.timeout_s, self.entries,
                            self._done, self.stats, window_bytes=t.max_in_flight, window_payloads=t.window_payloads,
                            missed=self._missed)
        self.in_flight: dict[tuple[str, str], int] = {}  # (transfer, payload) -> bytes, not yet staged everywhere
        self.in_flight_bytes = 0
        self.rejected: dict[str, dict[str, dict[str, str]]] = {}  # transfer -> receiver -> payload -> why
        self.lost: dict[str, dict[str, dict[str, str]]] = {}  # transfer -> receiver -> payload or MANIFEST -> why
        self._error: str | None = None  # why the transfer cannot go on; raised by the next _turn

    def send(self, transfer, payload_id, data):
        tid = transfer.transfer_id
        self._turn(0)
        while self.in_flight and (self.in_flight_bytes + len(data) > self.t.max_in_flight
                                  or len(self.in_flight) >= self.t.window_payloads):
            self._turn(0.05)  # back-pressure: the slowest node sets the pace
        if (tid, payload_id) in self.in_flight:
            return  # a retry of a payload still on its way: it arrives at least once anyway
        head = dumps({"kind": "payload", "transfer_id": tid, "producer_id": self.id,
                      "payload_id": payload_id, "size": len(data)})
        entry = Entry((tid, self.id, payload_id), head, data, len(data), [])
        self.entries[entry.key] = entry
        self.in_flight[(tid, payload_id)] = len(data)
        self.in_flight_bytes += len(data)
        self.links.add(entry)
        self._done(entry)  # settled at once if every node is given up for this transfer
        self.links.pump()
        while entry.key in self.entries and not entry.handed:  # until a relay took it, or none can
            self._turn(0.05)
        if self._error is not None:
            self._fail(self._error)

    def flush(self, transfer, payload_ids):
        tid = transfer.transfer_id
        self.links.manifest(tid, dumps({"kind": "manifest", "transfer_id": tid, "producer_id": self.id,
                                        "payload_ids": list(payload_ids)}))
        while self.in_flight or self.links.holds_manifest(tid):
            self._turn(0.05)
        rejected, lost = self.rejected.pop(tid, {}), self.lost.pop(tid, None)
        if lost:
            raise self._lost_error(tid, lost, rejected)
        return rejected

    def _turn(self, timeout_s: float) -> None:
        """Send what the links take, read acks and connection events, give up stalled links."""
        self.links.pump()
        ready = dict(self.poller.poll(int(timeout_s * 1000)))
        self.links.handle(ready)
        self.links.check(time.monotonic())
        self.links.pump()
        if self._error is not None:
            self._fail(self._error)

    def _done(self, entry: Entry) -> None:
        """An entry's link answered or was given up; once all did, record the outcome."""
        if entry.waiting or self.entries.get(entry.key) is not entry:
            return
        del self.entries[entry.key]
        tid, _, pid = entry.key
        self.in_flight_bytes -= self.in_flight.pop((tid, pid), 0)
        for rx, why in entry.rejected.items():
            self.rejected.setdefault(tid, {}).setdefault(rx, {})[pid] = why
        for rx, why in entry.lost.items():
            self.lost.setdefault(tid, {}).setdefault(rx, {})[pid] = why
        trim(self.rejected)
        trim(self.lost)
        answered = entry.staged + len(entry.rejected) + len(entry.lost)
        if entry.lost and not entry.staged and not entry.rejected:  # it reached no one: the transfer is over
            self._error = str(self._lost_error(tid, self.lost.pop(tid), self.rejected.pop(tid, {})))
        elif answered != len(self.t.nodes):
            self._error = (f"relay transport: the ack of payload {pid} accounts for {answered} of "
                           f"{len(self.t.nodes)} receivers: do all nodes share this 'nodes' configuration?")

    def _missed(self, transfer: str, lost: dict[str, str]) -> None:
        for rx, why in lost.items():
            self.lost.setdefault(transfer, {}).setdefault(rx, {}).setdefault(MANIFEST, why)

    def _lost_error(self, tid: str, lost: dict, rejected: dict) -> TransportError:
        pids = sorted({pid for d in lost.values() for pid in d if pid != MANIFEST})
        what = f"{len(pids)} payload(s)"
        if any(MANIFEST in d for d in lost.values()):
            what = f"{what} or get the manifest" if pids else "get the manifest"
        reasons = sorted({why for d in lost.values() for why in d.values()})
        e = TransportError(f"relay transport: receivers {sorted(lost)} did not stage {what} of transfer {tid}: "
                           + "; ".join(reasons))
        e.lost = {rx: sorted(d) for rx, d in lost.items()}  # receiver -> payload ids (and MANIFEST)
        e.rejected = rejected  # what flush would have returned
        return e

    def _fail(self, message: str):
        # The transfer is lost; forget it so the next one starts with an empty window
        # (late acks of this one are ignored as stale).
        self._error = None
        self.entries.clear()
        self.links.reset()
        self.in_flight.clear()
        self.in_flight_bytes = 0
        raise TransportError(message)

    def close(self):
        self.in_flight.clear()
        self.entries.clear()
        self.links.close()
        self.ctx.term()


# --- receiver end -----------------------------------------------------------------------

class _Receiver(ReceiverEnd):
    """A node's receiver end: the local Receiver's side of the node's forwarding thread."""

    def __init__(self, t: RelayTransport, receiver_id: str):
        self.id = receiver_id
        self.node = RelayNode(t, receiver_id)  # binds the node's ROUTER; raises what stops it
        self.stats = self.node.stats  # the same dict, kept up to date by the forwarding thread

    def poll(self, timeout_s):
        if self.node.error is not None:
            raise TransportError(f"relay {self.id}: forwarding stopped: {self.node.error}")
        return self.node.next_event(timeout_s)

    def staged(self, transfer_id, producer_id, payload_id, error):
        self.node.staged((transfer_id, producer_id, payload_id), error)

    def reply(self, kind, meta):
        self.node.reply({**meta, "kind": kind, "receiver": self.id})

    def close(self):
        self.node.close()


# --- coordinator -----------------------------------------------------------------------

class _Coordinator(CoordinatorEnd):
    """Talks to every node directly; collects replies on the `coordinator` endpoint."""

    def __init__(self, t: RelayTransport):
        self.t = t
        self.ctx = zmq.Context()
        self.inbox = zsocket(self.ctx, zmq.PULL, t, server=True)
        bind = t.config.get("coordinator_bind", t.config["coordinator"])
        self.auth = None
        try:
            self.auth = bind_server(self.ctx, self.inbox, t, bind, "the coordinator")
        except zmq.ZMQError as e:
            self.inbox.close(0)
            self.ctx.term()
            raise TransportError(f"relay transport: the coordinator cannot bind {bind}: {e}") from None
        # Linger so a last broadcast (commit, shutdown) still leaves when we close right after it.
        self.out = [dealer(self.ctx, t, "coordinator", t.endpoint(i), linger_ms=int(min(t.timeout_s, 2) * 1000))
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
            else:
                self.passed_over(msg, kind, transfer_id)
        return replies

    def close(self):
        self.inbox.close(0)
        for s in self.out:
            s.close()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
