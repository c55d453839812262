"""Object-storage transport: producers, receivers and the coordinator share only a bucket.

Everything travels through S3 (AWS or any S3-compatible store), so a trainer and rollout
clusters in different regions need nothing but access to one bucket. No end accepts a
connection; every end polls, `poll_s` apart.

Layout under `{prefix}/` (ids must match `[A-Za-z0-9][A-Za-z0-9._-]*`: they never add a level):

    receivers/{receiver}.json                          a receiver end is open (written on open, deleted on close)
    active/{tid}                                       a transfer is in progress (producers; coordinator removes)
    transfers/{tid}/payloads/{producer}/{payload_id}.ndcr            encoded payloads
    transfers/{tid}/manifests/{producer}.json                        a producer's payload list (flush)
    transfers/{tid}/staged/{producer}/{payload_id}/{receiver}.ok     acks; `.rejected` holds the reason
    control/{receiver}/{seq:020d}.json                 coordinator -> receiver: begin/commit/abort/verify/shutdown
    replies/{tid}/{kind}/{receiver}.json               receiver -> coordinator: ready / applied / verified
    commits/v{N:08d}.json                              commit records, created with If-None-Match

Choices, and why:
- Producer ids are in payload and ack keys: a receiver knows whom to answer from the
  listing alone (even when a body cannot be read), and a producer lists only its own acks.
  An ack's outcome is in its name, so producers read the bodies of rejections only: acks
  cost them one LIST per poll, not one GET per payload and receiver.
- Discovery: a receiver lists the manifests, then the payloads, of the transfer its last
  `begin` named (before any begin: of every transfer with an `active/` marker, which is
  how bare ends without a coordinator work). A manifest is written after all its payloads,
  so they are in the same round's listing and its event is queued after theirs. Listing
  stops once every producer of the begin has a manifest and every listed payload was seen.
  Each payload is delivered once per begin; the receiver dedups by id.
- Presence: `send`/`flush` of a new transfer first waits (up to timeout_s) until every
  receiver has a `receivers/` object, so a missing receiver fails at once, by name, before
  anything is uploaded for it (the local transport's socket check, in object form).
- Control messages are read, then deleted, by their receiver, which lists only what is
  pending (no StartAfter: messages of a restarted coordinator whose clock is behind are not
  skipped). `seq` starts at the coordinator's clock in microseconds and counts up, so one
  coordinator's messages arrive in order. A coordinator that starts deletes the control
  messages and `active/` markers a previous one left (those transfers will never finish).
  A retried write can bring a message back after its receiver deleted it (the first try
  landed, its answer was lost): a receiver remembers what it handled under each key (its
  last 4096 keys) and drops the same message under the same key.
- Integrity: every object carries its SHA-256, checked by the server on writes and by the
  reader on every read (see `s3_store`). A payload that fails its check in three reads is
  rejected by the receiver with that reason. The codec's XXH3-128/HMAC still protect end to end.
- Back-pressure: `send` uploads in the background (`upload_concurrency` at a time) and blocks
  while the payloads not yet staged by every receiver would exceed `max_in_flight_bytes`.
  Receivers fetch at most `prefetch` payloads ahead and write acks `ack_concurrency` at a
  time. Payloads of `multipart_threshold` bytes or more go up in `part_size` parts.
- Commit records: of two coordinators committing version N, the second gets HTTP 412 and
  `AlreadyCommitted` (a HEAD first also stops stores that ignore the condition, bar a race).
  A 412 can also answer a retry of one's own create whose first try landed: the record
  stored is then compared with the one meant, byte for byte (the body is made once, and
  names the transfer), and only another coordinator's record is `AlreadyCommitted`.
- Faults: every store operation retries transient failures (5xx, throttling, timeouts,
  resets, bodies cut off) beyond botocore's `max_attempts`, for up to `retry_s`, then fails
  closed with a TransportError naming the operation, the object, the endpoint and the bucket
  (see `s3_store`). Whatever runs the failed operation then fails: a producer's send/flush,
  a receiver's poll or reply (a payload that cannot be read is rejected, naming it), the
  coordinator's collect; nothing is taken for absent because it could not be read.
- What stays: a producer deletes each payload once every receiver staged it (unless
  `keep_payloads`) and the acks it read; the coordinator deletes the replies it collected
  and, on commit or abort, the rest of the transfer (with `keep_payloads`, a committed
  transfer's payloads and manifests stay, for catch-up). Between refits the bucket holds the
  commit records (and kept transfers), plus at times a few small objects of late peers of an
  aborted transfer. `cleanup()` deletes everything under the prefix, commit records and
  unfinished multipart uploads included: call it when the job's history is not needed.
- Bad input fails fast: opening an end checks the bucket (HEAD, retried on transient
  failures only, until `timeout_s`); a missing bucket, refused credentials or an unreachable endpoint
  is a TransportError naming the endpoint and bucket. Every wait is bounded by `timeout_s`
  (plus, for the store operation under way, `retry_s` and one attempt's timeouts).

Configuration: bucket (required), endpoint_url (default: AWS), region, prefix ("nemo-dcr"),
timeout_s (120), poll_s (0.05), max_in_flight_bytes (256 MiB), part_size (64 MiB),
multipart_threshold (= part_size), upload_concurrency (4), prefetch (4), ack_concurrency
(8), max_attempts (3, botocore's, per call), retry_s (= timeout_s: how long one operation
retries transient failures), connect_timeout_s (timeout_s / 4, within 1..10 s),
read_timeout_s (timeout_s, at most 60 s), addressing_style ("path" with an endpoint_url,
else "auto"), keep_payloads (False). Credentials: the standard AWS chain (`profile`) or
access_key / secret_key / session_token (see `s3_store`); never logged.
Cost: an idle receiver sends one LIST per `poll_s` (two before its first begin).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from nemo_dcr.commit_log import AlreadyCommitted, CommitLog
from nemo_dcr.errors import TransportError
from nemo_dcr.records import TransferInfo
from nemo_dcr.transport import (
    CoordinatorEnd,
    Event,
    ProducerEnd,
    ReceiverEnd,
    Transport,
    dumps,
)
from nemo_dcr.transports.s3_store import Conflict, Exists, Missing, ObjectStore, S3Bucket

MiB = 1 << 20
DEFAULTS = {
    "endpoint_url": None, "region": None, "prefix": "nemo-dcr", "timeout_s": 120.0, "poll_s": 0.05,
    "max_in_flight_bytes": 256 * MiB, "part_size": 64 * MiB, "multipart_threshold": None,
    "upload_concurrency": 4, "prefetch": 4, "ack_concurrency": 8, "max_attempts": 3, "addressing_style": None,
    "keep_payloads": False, "retry_s": None, "connect_timeout_s": None, "read_timeout_s": None,
}
_REMEMBERED = 4096  # control keys a receiver remembers having handled
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def _id(value, what: str) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise ValueError(f"s3 transport: {what} {value!r} must match {_ID.pattern}")
    return value


class S3Transport(Transport):
    name = "s3"

    def __init__(self, config=None, *, receivers=None):
        super().__init__({**DEFAULTS, **(config or {})}, receivers=receivers)
        c = self.config
        if not c.get("bucket"):
            raise ValueError("s3 transport: 'bucket' is required")
        self.bucket = str(c["bucket"])
        self.prefix = str(c["prefix"] or "").strip("/")
        if not self.prefix:
            raise ValueError("s3 transport: 'prefix' must not be empty (cleanup() deletes everything under it)")
        self.timeout_s, self.poll_s = float(c["timeout_s"]), float(c["poll_s"])
        self.max_in_flight = int(c["max_in_flight_bytes"])
        self.part_size = int(c["part_size"])
        self.multipart_threshold = int(c["multipart_threshold"] or self.part_size)
        self.upload_concurrency, self.prefetch = max(1, int(c["upload_concurrency"])), max(0, int(c["prefetch"]))
        self.ack_concurrency = max(1, int(c["ack_concurrency"]))
        self.keep_payloads = bool(c["keep_payloads"])
        if self.max_in_flight <= 0:
            raise ValueError(f"s3 transport: max_in_flight_bytes must be > 0, got {self.max_in_flight}")
        if self.part_size < 5 * MiB:
            raise ValueError(f"s3 transport: part_size must be at least 5 MiB (S3's minimum), got {self.part_size}")
        for r in self.receivers:
            _id(r, "receiver id")
        # The bucket and how to reach it; every end opens its own ObjectStore (one client) on it.
        self.s3 = S3Bucket(c, timeout_s=self.timeout_s, part_size=self.part_size,
                           multipart_threshold=self.multipart_threshold, upload_concurrency=self.upload_concurrency,
                           pool_connections=max(10, self.upload_concurrency + self.prefetch + self.ack_concurrency),
                           retry_s=c["retry_s"], connect_timeout_s=c["connect_timeout_s"],
                           read_timeout_s=c["read_timeout_s"])
        self.where = self.s3.where

    def __repr__(self):  # never shows credentials
        return f"S3Transport({self.where}, prefix {self.prefix!r}, receivers {self.receivers})"

    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def client(self, max_attempts: int | None = None):
        """A new boto3 S3 client for the bucket (the caller closes it)."""
        return self.s3.client(max_attempts)

    def check_bucket(self) -> None:
        """Fail with a clear error, within timeout_s, if the bucket cannot be used."""
        self.s3.check()

    def producer(self, producer_id):
        return _S3Producer(self, _id(producer_id, "producer id"))

    def receiver(self, receiver_id):
        return _S3Receiver(self, _id(receiver_id, "receiver id"))

    def coordinator(self):
        if not self.receivers:
            raise ValueError("s3 transport: a coordinator needs the list of receiver ids")
        return _S3Coordinator(self)

    def commit_log(self, state_dir: str):
        """Commit records live in the bucket (`{prefix}/commits/`), not in `state_dir`:
        coordinators in different places see the same records."""
        return S3CommitLog(self)

    def history(self):
        """Committed deltas and anchors in the bucket (`{prefix}/history/`)."""
        from nemo_dcr.transports.s3_history import S3History

        return S3History(self)

    def cleanup(self) -> None:
        store = ObjectStore(self.s3)
        try:
            store.abort_uploads(self.prefix + "/")
            store.delete_prefix(self.prefix + "/")
        finally:
            store.close()


# --- producer --------------------------------------------------------------------------

@dataclass
class _Sent:
    key: str
    size: int
    waiting: set[str]
    upload: Future
    uploaded: bool = False


class _S3Producer(ProducerEnd):
    def __init__(self, t: S3Transport, producer_id: str):
        self.t, self.id = t, producer_id
        self.store = ObjectStore(t.s3)
        self.pool = ThreadPoolExecutor(t.upload_concurrency, thread_name_prefix=f"s3-{producer_id}")
        self.tid: str | None = None
        self.in_flight: dict[str, _Sent] = {}
        self.in_flight_bytes = 0
        self.rejected: dict[str, dict[str, str]] = {}

    def _start(self, transfer: TransferInfo) -> None:
        if transfer.transfer_id == self.tid:
            return
        self._forget()  # leftovers of a transfer that failed: it will not commit
        self.tid, self.rejected = None, {}
        tid = _id(transfer.transfer_id, "transfer id")
        base = self.t.key("receivers") + "/"
        deadline = time.monotonic() + self.t.timeout_s
        while missing := sorted(set(self.t.receivers) - {k[len(base):].removesuffix(".json")
                                                         for k, _ in self.store.list(base)}):
            if time.monotonic() >= deadline:
                raise TransportError(f"s3 transport ({self.t.where}): receiver{'s' * (len(missing) > 1)} "
                                     f"{', '.join(missing)} opened no receiver end ({base}<id>.json) "
                                     f"within {self.t.timeout_s:g} s")
            time.sleep(self.t.poll_s)
        self.store.put(self.t.key("active", tid), b"{}")  # lets receivers that saw no begin find it
        self.tid = tid

    def send(self, transfer, payload_id, data):
        self._start(transfer)
        _id(payload_id, "payload id")
        self._wait(lambda: not self.in_flight or self.in_flight_bytes + len(data) <= self.t.max_in_flight)
        old = self.in_flight.pop(payload_id, None)  # a resend: same identity, identical bytes
        if old is not None:
            old.upload.exception()
            self.in_flight_bytes -= old.size
        key = self.t.key("transfers", self.tid, "payloads", self.id, f"{payload_id}.ndcr")
        self.in_flight[payload_id] = _Sent(key, len(data), set(self.t.receivers),
                                           self.pool.submit(self.store.put, key, data))
        self.in_flight_bytes += len(data)

    def flush(self, transfer, payload_ids):
        self._start(transfer)
        for s in self.in_flight.values():  # the manifest must not be visible before its payloads
            s.upload.result()
        manifest = {"kind": "manifest", "transfer_id": self.tid, "producer_id": self.id,
                    "payload_ids": list(payload_ids)}
        self.store.put(self.t.key("transfers", self.tid, "manifests", f"{self.id}.json"), dumps(manifest))
        self._wait(lambda: not self.in_flight)
        rejected, self.rejected = self.rejected, {}
        return rejected

    def _wait(self, done) -> None:
        deadline = time.monotonic() + self.t.timeout_s
        while not done():
            if self._poll():
                deadline = time.monotonic() + self.t.timeout_s
            elif time.monotonic() >= deadline:
                waiting = sorted({r for s in self.in_flight.values() for r in s.waiting})
                uploading = sum(not s.upload.done() for s in self.in_flight.values())
                raise TransportError(
                    f"s3 transport ({self.t.where}): receivers {waiting} did not stage {len(self.in_flight)} "
                    f"payload(s) of transfer {self.tid} within {self.t.timeout_s:g} s"
                    + (f" ({uploading} still uploading)" if uploading else ""))
            else:
                time.sleep(self.t.poll_s)

    def _poll(self) -> bool:
        """One round of acks; True when anything moved."""
        progressed, garbage = False, []
        for s in self.in_flight.values():
            if s.upload.done() and not s.uploaded:
                s.upload.result()  # raises the upload's TransportError, naming the object
                s.uploaded = progressed = True
        base = self.t.key("transfers", self.tid, "staged", self.id) + "/"
        for key, _ in self.store.list(base):
            garbage.append(key)
            pid, _, leaf = key[len(base):].partition("/")
            rx, _, status = leaf.rpartition(".")
            s = self.in_flight.get(pid)
            if s is None or rx not in s.waiting or status not in ("ok", "rejected"):
                continue  # stale or duplicate acknowledgement
            if status == "rejected":
                reason = (self.store.get_json(key) or {}).get("error") or "rejected (reason unreadable)"
                self.rejected.setdefault(rx, {})[pid] = str(reason)
            s.waiting.discard(rx)
            progressed = True
        for pid, s in list(self.in_flight.items()):
            if not s.waiting and s.uploaded:
                del self.in_flight[pid]
                self.in_flight_bytes -= s.size
                if not self.t.keep_payloads:
                    garbage.append(s.key)
        if garbage:
            self.store.delete(garbage)
        return progressed

    def _forget(self) -> None:
        keys = []
        for s in self.in_flight.values():
            if s.upload.cancel() or s.upload.exception() is None:
                keys.append(s.key)
        self.in_flight.clear()
        self.in_flight_bytes = 0
        self.store.discard(keys)  # else cleanup() or the coordinator's abort removes them

    def close(self):
        try:
            self._forget()
        finally:
            self.pool.shutdown(wait=True)
            self.store.close()


# --- receiver --------------------------------------------------------------------------

@dataclass
class _Open:
    """What the receiver end has discovered of one transfer."""

    tid: str
    producers: tuple[str, ...] = ()  # known from the begin message
    manifests: dict[str, list[str]] = field(default_factory=dict)
    seen: set[tuple[str, str]] = field(default_factory=set)  # (producer, payload id) queued
    complete: bool = False


@dataclass
class _Fetch:
    meta: dict
    future: Future | None = None


class _S3Receiver(ReceiverEnd):
    def __init__(self, t: S3Transport, receiver_id: str):
        self.t, self.id = t, receiver_id
        self.store = ObjectStore(t.s3)
        self.inbox = t.key("control", receiver_id) + "/"
        self.consumed: set[str] = set()  # control keys handled, possibly not yet gone from listings
        self.handled: OrderedDict[str, str] = OrderedDict()  # control key -> digest of the message handled
        self.items: deque = deque()  # Event | _Fetch, in delivery order
        self.open: dict[str, _Open] = {}
        self.closed: set[str] = set()  # transfers committed, aborted or superseded
        self.begun = False  # after a begin, only begun transfers are discovered
        self.fetcher = ThreadPoolExecutor(max(1, t.prefetch), thread_name_prefix=f"s3-{receiver_id}-get")
        self.acker = ThreadPoolExecutor(t.ack_concurrency, thread_name_prefix=f"s3-{receiver_id}-ack")
        self.acks: list[Future] = []
        self.presence = t.key("receivers", f"{receiver_id}.json")
        self.store.put(self.presence, dumps({"kind": "receiver", "receiver": receiver_id}))

    def poll(self, timeout_s):
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            while self.items:
                event = self._next()
                if event is not None:
                    return event
            self._sync()  # the store retries blips; a store failing for retry_s raises here
            if self.items:
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(self.t.poll_s, left))

    def _sync(self) -> None:
        listed = [k for k, _ in self.store.list(self.inbox)]
        self.consumed &= set(listed)
        new = sorted(k for k in listed if k not in self.consumed)
        for key in new:
            msg = self.store.get_json(key)
            self.consumed.add(key)
            if msg is None or not self._first_time(key, msg):
                continue
            self._track(msg)
            self.items.append(Event(msg["kind"], msg))
        self.store.discard(new)  # if that fails, `consumed` keeps them from being handled twice
        if not self.begun:  # no coordinator has spoken: find transfers by their producers' markers
            base = self.t.key("active") + "/"
            active = {k[len(base):] for k, _ in self.store.list(base)}
            for tid in set(self.open) - active:  # finished (or cleaned up)
                self.closed.add(tid)
                del self.open[tid]
            for tid in sorted(active - self.closed - set(self.open)):
                if _ID.match(tid):
                    self.open[tid] = _Open(tid)
        for o in list(self.open.values()):
            if not o.complete:
                self._discover(o)
        self._prefetch()

    def _first_time(self, key: str, msg: dict) -> bool:
        """False for a message handled before under this key (brought back by a retried write)."""
        digest = hashlib.sha256(json.dumps(msg, sort_keys=True, default=str).encode()).hexdigest()
        if self.handled.get(key) == digest:
            return False
        self.handled[key] = digest
        self.handled.move_to_end(key)
        while len(self.handled) > _REMEMBERED:
            self.handled.popitem(last=False)
        return True

    def _track(self, msg: dict) -> None:
        kind, tid = msg["kind"], msg.get("transfer_id")
        if kind == "begin" and isinstance(tid, str) and _ID.match(tid):
            self.begun = True
            self.closed.update(t for t in self.open if t != tid)  # a receiver works on one transfer
            producers = (msg.get("transfer") or {}).get("producers") or ()
            self.open = {tid: _Open(tid, tuple(str(p) for p in producers))}
            self.closed.discard(tid)
        elif kind in ("commit", "abort") and tid in self.open:
            del self.open[tid]
            self.closed.add(tid)

    def _discover(self, o: _Open) -> None:
        base = self.t.key("transfers", o.tid) + "/"
        manifests = []
        # Manifests are listed before payloads: a manifest's payloads, all written before it,
        # are then in this round's payload listing, and its event can follow theirs.
        for key, _ in self.store.list(base + "manifests/"):
            producer = key[len(base + "manifests/"):].removesuffix(".json")
            if producer in o.manifests:
                continue
            msg = self.store.get_json(key)
            if msg is None or msg.get("producer_id") != producer or msg.get("transfer_id") != o.tid:
                continue
            o.manifests[producer] = [str(p) for p in msg.get("payload_ids", ())]
            manifests.append(Event("manifest", msg))
        for key, size in self.store.list(base + "payloads/"):
            producer, _, leaf = key[len(base + "payloads/"):].partition("/")
            pid = leaf.removesuffix(".ndcr")
            if (producer, pid) in o.seen or not leaf.endswith(".ndcr"):
                continue
            o.seen.add((producer, pid))
            self.items.append(_Fetch({"kind": "payload", "transfer_id": o.tid, "producer_id": producer,
                                      "payload_id": pid, "key": key, "size": size}))
        self.items.extend(manifests)
        o.complete = bool(o.producers) and set(o.producers) <= set(o.manifests) and all(
            (p, pid) in o.seen for p, ids in o.manifests.items() for pid in ids)

    def _prefetch(self) -> None:
        ahead = 0
        for item in self.items:
            if ahead >= self.t.prefetch:
                return
            if isinstance(item, _Fetch):
                if item.future is None:
                    item.future = self.fetcher.submit(self.store.get, item.meta["key"])
                ahead += 1

    def _next(self) -> Event | None:
        item = self.items.popleft()
        if isinstance(item, Event):
            return item
        try:
            data = item.future.result() if item.future is not None else self.store.get(item.meta["key"])
        except Missing:
            return None  # deleted after listing: its transfer was aborted or cleaned up
        except TransportError as e:  # checksum failure, or a store that stayed unreadable for retry_s:
            # the receiver rejects it, naming the object (the transfer fails; nothing is applied from it)
            return Event("payload", {**item.meta, "error": str(e)}, None)
        finally:
            self._prefetch()
        return Event("payload", item.meta, data)

    def staged(self, transfer_id, producer_id, payload_id, error):
        self._reap_acks()
        status = "ok" if error is None else "rejected"
        key = self.t.key("transfers", _id(transfer_id, "transfer id"), "staged", _id(producer_id, "producer id"),
                         _id(payload_id, "payload id"), f"{self.id}.{status}")
        body = dumps({"kind": "staged", "transfer_id": transfer_id, "payload_id": payload_id,
                      "receiver": self.id, "error": error})
        self.acks.append(self.acker.submit(self.store.put, key, body))

    def _reap_acks(self, wait: bool = False) -> None:
        pending = []
        for f in self.acks:
            if wait or f.done():
                f.result()  # an ack that could not be written is this end's failure
            else:
                pending.append(f)
        self.acks = pending

    def reply(self, kind, meta):
        self._reap_acks()
        tid = _id(meta.get("transfer_id"), "transfer id")
        self.store.put(self.t.key("replies", tid, _id(kind, "reply kind"), f"{self.id}.json"),
                       dumps({**meta, "kind": kind, "receiver": self.id}))

    def close(self):
        try:
            self._reap_acks(wait=True)
        finally:
            for item in self.items:
                if isinstance(item, _Fetch) and item.future is not None:
                    item.future.cancel()
            self.items.clear()
            self.fetcher.shutdown(wait=True)
            self.acker.shutdown(wait=True)
            self.store.discard([self.presence])
            self.store.close()


# --- coordinator and commit records ----------------------------------------------------

class _S3Coordinator(CoordinatorEnd):
    def __init__(self, t: S3Transport):
        self.t = t
        self.store = ObjectStore(t.s3)
        self.pool = ThreadPoolExecutor(min(16, len(t.receivers)), thread_name_prefix="s3-coord")
        stale = self.store.list(t.key("control") + "/")
        last = max((int(m.group(1)) for k, _ in stale if (m := re.search(r"/(\d{20})\.json$", k))), default=-1)
        self.seq = max(last + 1, time.time_ns() // 1000)
        # A previous coordinator's messages and transfers will never finish: see the docstring.
        self.store.delete([k for k, _ in stale] + [k for k, _ in self.store.list(t.key("active") + "/")])

    def broadcast(self, kind, meta):
        name, self.seq = f"{self.seq:020d}.json", self.seq + 1
        body = dumps({**meta, "kind": kind})
        list(self.pool.map(lambda rx: self.store.put(self.t.key("control", rx, name), body), self.t.receivers))
        tid = meta.get("transfer_id")
        if kind in ("commit", "abort") and isinstance(tid, str) and _ID.match(tid):
            self._purge(tid, keep=kind == "commit" and self.t.keep_payloads)

    def _purge(self, tid: str, keep: bool) -> None:
        """Everything of a finished transfer (with keep: all but its payloads and manifests)."""
        base = self.t.key("transfers", tid) + "/"
        kept = (base + "payloads/", base + "manifests/") if keep else ()
        try:
            self.store.delete_prefix(base, keep=lambda k: k.startswith(kept) if kept else False)
            self.store.delete_prefix(self.t.key("replies", tid) + "/")
            self.store.delete([self.t.key("active", tid)])
        except TransportError:
            pass  # leftovers are small; cleanup() removes them

    def collect(self, kind, transfer_id, timeout_s):
        base = self.t.key("replies", _id(transfer_id, "transfer id"), _id(kind, "reply kind")) + "/"
        replies: dict[str, dict] = {}
        keys: list[str] = []
        deadline = time.monotonic() + timeout_s
        while True:
            new = [k for k, _ in self.store.list(base)
                   if (rx := k[len(base):].removesuffix(".json")) in self.t.receivers and rx not in replies]
            for key, msg in zip(new, self.pool.map(self.store.get_json, new)):
                if msg and msg["kind"] == kind and msg.get("transfer_id") == transfer_id \
                        and msg.get("receiver") == key[len(base):].removesuffix(".json"):
                    replies[msg["receiver"]] = msg
                    keys.append(key)
            if len(replies) == len(self.t.receivers):
                break
            if time.monotonic() >= deadline:
                missing = sorted(set(self.t.receivers) - set(replies))
                raise TransportError(f"s3 transport ({self.t.where}): receivers {missing} sent no '{kind}' "
                                     f"for transfer {transfer_id} within {timeout_s:g} s")
            time.sleep(min(self.t.poll_s, max(deadline - time.monotonic(), 0)))
        self.store.discard(keys)
        return replies

    def close(self):
        self.pool.shutdown(wait=True)
        self.store.close()


class S3CommitLog(CommitLog):
    """Commit records `{prefix}/commits/v<N>.json`, created with a conditional write."""

    _NAME = re.compile(r"/v(\d{8,})\.json$")

    def __init__(self, t: S3Transport):
        self.t, self.store = t, ObjectStore(t.s3)
        self.base = t.key("commits") + "/"

    def latest(self) -> int:
        return max((int(m.group(1)) for k, _ in self.store.list(self.base) if (m := self._NAME.search(k))),
                   default=0)

    def write(self, info: TransferInfo, extra: dict) -> None:
        key = f"{self.base}v{info.target_version:08d}.json"
        where = f"s3://{self.t.bucket}/{key}"
        body = self.record(info, extra)  # made once: every retry must send these very bytes
        if self.store.exists(key):  # stores that ignore If-None-Match still cannot overwrite in sequence
            raise AlreadyCommitted(where)
        deadline = time.monotonic() + self.t.timeout_s
        while True:
            try:
                return self.store.put(key, body, if_none_match=True)
            except Exists:
                # Also the answer to a retry whose first try landed: then the record is ours.
                try:
                    if self.store.get(key) == body:
                        return
                except Missing:
                    pass
                raise AlreadyCommitted(where) from None
            except Conflict:  # another conditional write of this key is in progress: its outcome decides
                if time.monotonic() >= deadline:
                    raise TransportError(f"s3 transport ({self.t.where}): commit record {key} stayed in "
                                         f"conflict for {self.t.timeout_s:g} s") from None
                time.sleep(self.t.poll_s)

    def close(self) -> None:
        self.store.close()
