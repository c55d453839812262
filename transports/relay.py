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

Failures: a node gives up on a busy link (child or local receiver) without progress for
timeout_s * (height + 1 - depth) / (height + 2): its subtree is lost for that transfer,
the acks carry that up, and the producer raises a TransportError naming node and
endpoint. Deeper links give up first, so the node nearest the cause is named; the producer
waits timeout_s for the root. Delivery is at least once: a re-sent payload still in the
tree is merged (each sender acked), later it travels again (receivers dedup by id).
Payloads travel as raw frames, control as JSON; nothing is pickled.

Security: with `curve_secret_env` (the name of an environment variable holding a Z85
CURVE secret key, made by `nemo-dcr curve-keygen`) every socket is encrypted and
authenticated with ZeroMQ CURVE: nodes and the coordinator accept only peers that hold
the same key pair, so nobody without the secret can read payloads or inject control
messages. Without it, binding an endpoint that is not on loopback logs a warning.

Configuration: nodes, fanout (2), coordinator (tcp endpoint), coordinator_bind,
timeout_s (120), max_in_flight_bytes (256 MiB, per producer), window_bytes (64 MiB) and
window_payloads (256) per link, hwm (1024), local_queue (64), curve_secret_env (none).
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
from nemo_dcr.transports.relay_node import RelayNode, bind_server, dealer, trim, zsocket

log = logging.getLogger(__name__)

DEFAULTS = {"fanout": 2, "timeout_s": 120.0, "max_in_flight_bytes": 256 << 20, "window_bytes": 64 << 20,
            "window_payloads": 256, "hwm": 1024, "local_queue": 64}


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
    def __init__(self, t: RelayTransport, producer_id: str):
        self.t, self.id = t, producer_id
        self.ctx = zmq.Context()
        self.sock = dealer(self.ctx, t, f"producer:{producer_id}", t.endpoint(0))
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
            trim(self.rejected)

    def close(self):
        self.in_flight.clear()
        self.sock.close(0)
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
        return replies

    def close(self):
        self.inbox.close(0)
        for s in self.out:
            s.close()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
