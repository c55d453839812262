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
- Integrity: every object is written with its SHA-256 as the S3 checksum (checked by the
  server; per part for multipart uploads) and as user metadata `sha256` of the whole object.
  Reads ask for the server's checksum (`ChecksumMode=ENABLED`, checked by botocore) and always
  check length and `sha256` themselves (botocore skips composite multipart checksums). A
  mismatch in three reads is a TransportError naming the object; for a payload the receiver
  rejects it with that reason. The codec's BLAKE2b/HMAC still protect end to end.
- Back-pressure: `send` uploads in the background (`upload_concurrency` at a time) and blocks
  while the payloads not yet staged by every receiver would exceed `max_in_flight_bytes`.
  Receivers fetch at most `prefetch` payloads ahead and write acks `ack_concurrency` at a
  time. Payloads of `multipart_threshold` bytes or more go up in `part_size` parts.
- Commit records: of two coordinators committing version N, the second gets HTTP 412 and
  `AlreadyCommitted` (a HEAD first also stops stores that ignore the condition, bar a race).
- What stays: a producer deletes each payload once every receiver staged it (unless
  `keep_payloads`) and the acks it read; the coordinator deletes the replies it collected
  and, on commit or abort, the rest of the transfer (with `keep_payloads`, a committed
  transfer's payloads and manifests stay, for catch-up). Between refits the bucket holds the
  commit records (and kept transfers), plus at times a few small objects of late peers of an
  aborted transfer. `cleanup()` deletes everything under the prefix, commit records and
  unfinished multipart uploads included: call it when the job's history is not needed.
- Bad input fails fast: opening an end checks the bucket (HEAD, retried on connection errors
  only, until `timeout_s`); a missing bucket, refused credentials or an unreachable endpoint
  is a TransportError naming the endpoint and bucket. Every wait is bounded by `timeout_s`.

Configuration: bucket (required), endpoint_url (default: AWS), region, prefix ("nemo-dcr"),
timeout_s (120), poll_s (0.05), max_in_flight_bytes (256 MiB), part_size (64 MiB),
multipart_threshold (= part_size), upload_concurrency (4), prefetch (4), ack_concurrency
(8), max_attempts (3, botocore's), addressing_style ("path" with an endpoint_url, else
"auto"), keep_payloads (False). Credentials: the standard AWS chain (environment, files,
instance roles, `profile`) or access_key / secret_key / session_token; never logged.
Cost: an idle receiver sends one LIST per `poll_s` (two before its first begin).
"""

from __future__ import annotations

import base64
import hashlib
import re
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from nemo_dcr.commit import AlreadyCommitted, CommitLog
from nemo_dcr.errors import TransportError
from nemo_dcr.transport import (
    CoordinatorEnd,
    Event,
    ProducerEnd,
    ReceiverEnd,
    TransferInfo,
    Transport,
    dumps,
    loads,
)

try:
    import boto3
    from botocore import exceptions as bex
    from botocore.config import Config
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError("the s3 transport needs boto3: pip install 'nemo-dcr[s3]'") from e

MiB = 1 << 20
DEFAULTS = {
    "endpoint_url": None, "region": None, "prefix": "nemo-dcr", "timeout_s": 120.0, "poll_s": 0.05,
    "max_in_flight_bytes": 256 * MiB, "part_size": 64 * MiB, "multipart_threshold": None,
    "upload_concurrency": 4, "prefetch": 4, "ack_concurrency": 8, "max_attempts": 3, "addressing_style": None,
    "keep_payloads": False,
}
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_READS = 3  # reads of an object before a checksum mismatch is final
_SESSIONS: dict = {}
_SESSION_LOCK = threading.Lock()


def _id(value, what: str) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise ValueError(f"s3 transport: {what} {value!r} must match {_ID.pattern}")
    return value


def _sha256(data) -> bytes:
    return hashlib.sha256(data).digest()


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
        self.where = f"endpoint {c['endpoint_url'] or 'AWS S3 (' + str(c['region'] or 'default region') + ')'}, " \
                     f"bucket {self.bucket}"
        self._bucket_ok = False

    def __repr__(self):  # never shows credentials
        return f"S3Transport({self.where}, prefix {self.prefix!r}, receivers {self.receivers})"

    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def client(self, max_attempts: int | None = None):
        c = self.config
        with _SESSION_LOCK:  # one session per profile: clients share its loaded models (fast to make)
            session = _SESSIONS.get(c.get("profile"))
            if session is None:
                session = _SESSIONS[c.get("profile")] = boto3.session.Session(profile_name=c.get("profile"))
        region = c["region"] or session.region_name or ("us-east-1" if c["endpoint_url"] else None)
        style = c["addressing_style"] or ("path" if c["endpoint_url"] else "auto")
        # Connecting never takes a large share of timeout_s: an unreachable endpoint fails in time.
        cfg = Config(connect_timeout=min(max(self.timeout_s / 4, 1.0), 10.0), read_timeout=self.timeout_s,
                     retries={"mode": "standard", "max_attempts": int(max_attempts or c["max_attempts"])},
                     max_pool_connections=max(10, self.upload_concurrency + self.prefetch + self.ack_concurrency),
                     s3={"addressing_style": style})
        with _SESSION_LOCK:  # sessions are not thread-safe
            return session.client("s3", endpoint_url=c["endpoint_url"] or None, region_name=region, config=cfg,
                                  aws_access_key_id=c.get("access_key"), aws_secret_access_key=c.get("secret_key"),
                                  aws_session_token=c.get("session_token"))

    def check_bucket(self) -> None:
        """Fail with a clear error, within timeout_s, if the bucket cannot be used."""
        if self._bucket_ok:
            return
        s3 = self.client(max_attempts=1)
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                try:
                    s3.head_bucket(Bucket=self.bucket)
                    self._bucket_ok = True
                    return
                except (bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ReadTimeoutError,
                        bex.ConnectionClosedError) as e:
                    if time.monotonic() + 0.2 >= deadline:
                        raise TransportError(f"s3 transport ({self.where}): cannot reach the endpoint "
                                             f"within {self.timeout_s:g} s: {e}") from None
                    time.sleep(0.2)
                except (bex.ClientError, bex.BotoCoreError) as e:
                    raise _error(self, e, "checking the bucket") from None
        finally:
            s3.close()

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

    def cleanup(self) -> None:
        store = _Store(self)
        try:
            store.abort_uploads(self.prefix + "/")
            store.delete_prefix(self.prefix + "/")
        finally:
            store.close()


def _error(t: S3Transport, e: Exception, doing: str) -> TransportError:
    if isinstance(e, bex.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", "?"))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket" or (status == 404 and doing == "checking the bucket"):
            why = "the bucket does not exist"
        elif status == 403 or code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                                       "ExpiredToken", "InvalidToken"):
            why = f"access denied ({code}): check the credentials and the bucket's policy"
        elif status == 301 or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
            why = f"wrong region ({code}): set 'region' to the bucket's region"
        else:
            why = f"{code} (HTTP {status}): {err.get('Message', '')}".rstrip(": ")
    elif isinstance(e, (bex.NoCredentialsError, bex.PartialCredentialsError)):
        why = "no usable AWS credentials (set the standard AWS variables or files, or access_key/secret_key)"
    elif isinstance(e, (bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ConnectionClosedError)):
        why = f"cannot reach the endpoint: {e}"
    elif isinstance(e, bex.ReadTimeoutError):
        why = f"the endpoint did not answer within {t.timeout_s:g} s"
    else:
        why = f"{type(e).__name__}: {e}"
    return TransportError(f"s3 transport ({t.where}): {doing}: {why}")


class _Missing(Exception):
    """The object does not exist (any more)."""


class _Exists(Exception):
    """A conditional create found the object already there (HTTP 412)."""


class _Conflict(Exception):
    """A concurrent conditional write is in progress (HTTP 409): try again."""


class _Store:
    """One S3 client and the object operations every end needs, with checksums and errors."""

    def __init__(self, t: S3Transport):
        t.check_bucket()
        self.t, self.bucket = t, t.bucket
        self.s3 = t.client()

    def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        digest = _sha256(data)
        meta = {"sha256": digest.hex()}
        try:
            if len(data) >= self.t.multipart_threshold and not if_none_match:
                return self._put_parts(key, data, meta)
            extra = {"IfNoneMatch": "*"} if if_none_match else {}
            self.s3.put_object(Bucket=self.bucket, Key=key, Body=data, Metadata=meta, ChecksumAlgorithm="SHA256",
                               ChecksumSHA256=base64.b64encode(digest).decode(), **extra)
        except bex.ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if if_none_match and status == 412:
                raise _Exists(key) from None
            if if_none_match and status == 409:
                raise _Conflict(key) from None
            raise _error(self.t, e, f"writing {key}") from None
        except bex.BotoCoreError as e:
            raise _error(self.t, e, f"writing {key}") from None

    def _put_parts(self, key: str, data: bytes, meta: dict) -> None:
        size = self.t.part_size
        up = self.s3.create_multipart_upload(Bucket=self.bucket, Key=key, Metadata=meta, ChecksumAlgorithm="SHA256")
        uid = up["UploadId"]

        def part(n: int) -> dict:
            chunk = data[n * size:(n + 1) * size]
            checksum = base64.b64encode(_sha256(chunk)).decode()
            r = self.s3.upload_part(Bucket=self.bucket, Key=key, UploadId=uid, PartNumber=n + 1, Body=chunk,
                                    ChecksumAlgorithm="SHA256", ChecksumSHA256=checksum)
            return {"PartNumber": n + 1, "ETag": r["ETag"], "ChecksumSHA256": checksum}

        count = -(-len(data) // size)
        try:
            with ThreadPoolExecutor(min(count, self.t.upload_concurrency)) as pool:
                parts = list(pool.map(part, range(count)))
            self.s3.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=uid,
                                              MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self.s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=uid)
            except (bex.ClientError, bex.BotoCoreError):
                pass  # cleanup() aborts what is left
            raise

    def get(self, key: str) -> bytes:
        problem = ""
        for _ in range(_READS):
            try:
                r = self.s3.get_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
                body = r["Body"].read()
            except bex.FlexibleChecksumError as e:
                problem = f"S3 checksum mismatch ({e})"
                continue
            except bex.ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    raise _Missing(key) from None
                raise _error(self.t, e, f"reading {key}") from None
            except bex.BotoCoreError as e:
                raise _error(self.t, e, f"reading {key}") from None
            want = r.get("Metadata", {}).get("sha256")
            if want is None:
                raise TransportError(f"s3 transport ({self.t.where}): object {key} carries no sha256 checksum")
            if len(body) != r.get("ContentLength", len(body)) or _sha256(body).hex() != want:
                problem = f"content ({len(body)} bytes) does not match its SHA-256 checksum"
                continue
            return body
        raise TransportError(f"s3 transport ({self.t.where}): object {key} failed its checksum "
                             f"in {_READS} reads: {problem}")

    def get_json(self, key: str) -> dict | None:
        """A small control object, or None when it is gone or is not a message of ours
        (a peer waiting for it then times out naming its sender)."""
        try:
            return loads(self.get(key))
        except (_Missing, TransportError):
            return None

    def exists(self, key: str) -> bool:
        try:
            self.s3.head_object(Bucket=self.bucket, Key=key)
            return True
        except bex.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return False
            raise _error(self.t, e, f"reading {key}") from None
        except bex.BotoCoreError as e:
            raise _error(self.t, e, f"reading {key}") from None

    def list(self, prefix: str) -> list[tuple[str, int]]:
        out, kw = [], {}
        try:
            while True:
                r = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=prefix, **kw)
                out += [(o["Key"], int(o["Size"])) for o in r.get("Contents", ())]
                if not r.get("IsTruncated"):
                    return out
                kw = {"ContinuationToken": r["NextContinuationToken"]}
        except (bex.ClientError, bex.BotoCoreError) as e:
            raise _error(self.t, e, f"listing {prefix}") from None

    def delete(self, keys) -> None:
        keys = list(keys)
        try:
            for i in range(0, len(keys), 1000):
                r = self.s3.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
                if r.get("Errors"):
                    err = r["Errors"][0]
                    raise TransportError(f"s3 transport ({self.t.where}): deleting {err.get('Key')}: "
                                         f"{err.get('Code')}: {err.get('Message', '')} "
                                         f"(and {len(r['Errors']) - 1} more)")
        except (bex.ClientError, bex.BotoCoreError) as e:
            raise _error(self.t, e, f"deleting {len(keys)} object(s)") from None

    def delete_prefix(self, prefix: str, keep=lambda key: False) -> None:
        self.delete(k for k, _ in self.list(prefix) if not keep(k))

    def abort_uploads(self, prefix: str) -> None:
        kw: dict = {}
        try:
            while True:
                r = self.s3.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix, **kw)
                for u in r.get("Uploads", ()):
                    self.s3.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])
                if not r.get("IsTruncated"):
                    return
                kw = {"KeyMarker": r["NextKeyMarker"], "UploadIdMarker": r["NextUploadIdMarker"]}
        except (bex.ClientError, bex.BotoCoreError) as e:
            raise _error(self.t, e, f"aborting multipart uploads under {prefix}") from None

    def close(self) -> None:
        self.s3.close()


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
        self.store = _Store(t)
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
        if keys:
            try:
                self.store.delete(keys)
            except TransportError:
                pass  # cleanup() or the coordinator's abort removes them

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
        self.store = _Store(t)
        self.inbox = t.key("control", receiver_id) + "/"
        self.consumed: set[str] = set()  # control keys handled, possibly not yet gone from listings
        self.items: deque = deque()  # Event | _Fetch, in delivery order
        self.open: dict[str, _Open] = {}
        self.closed: set[str] = set()  # transfers committed, aborted or superseded
        self.begun = False  # after a begin, only begun transfers are discovered
        self.fetcher = ThreadPoolExecutor(max(1, t.prefetch), thread_name_prefix=f"s3-{receiver_id}-get")
        self.acker = ThreadPoolExecutor(t.ack_concurrency, thread_name_prefix=f"s3-{receiver_id}-ack")
        self.acks: list[Future] = []
        self.failing_since: float | None = None
        self.presence = t.key("receivers", f"{receiver_id}.json")
        self.store.put(self.presence, dumps({"kind": "receiver", "receiver": receiver_id}))

    def poll(self, timeout_s):
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            while self.items:
                event = self._next()
                if event is not None:
                    return event
            self._sync()
            if self.items:
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(self.t.poll_s, left))

    def _sync(self) -> None:
        try:
            self._sync_once()
            self.failing_since = None
        except TransportError:
            # A blip must not stop the receiver; a store gone for timeout_s must.
            now = time.monotonic()
            self.failing_since = self.failing_since or now
            if now - self.failing_since >= self.t.timeout_s:
                raise

    def _sync_once(self) -> None:
        listed = [k for k, _ in self.store.list(self.inbox)]
        self.consumed &= set(listed)
        new = sorted(k for k in listed if k not in self.consumed)
        for key in new:
            msg = self.store.get_json(key)
            self.consumed.add(key)
            if msg is not None:
                self._track(msg)
                self.items.append(Event(msg["kind"], msg))
        if new:
            try:
                self.store.delete(new)
            except TransportError:
                pass  # `consumed` keeps them from being handled twice
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
        except _Missing:
            return None  # deleted after listing: its transfer was aborted or cleaned up
        except TransportError as e:  # checksum failure: the receiver rejects it, naming the object
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
            try:
                self.store.delete([self.presence])
            except TransportError:
                pass
            self.store.close()


# --- coordinator and commit records ----------------------------------------------------

class _S3Coordinator(CoordinatorEnd):
    def __init__(self, t: S3Transport):
        self.t = t
        self.store = _Store(t)
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
        try:
            self.store.delete(keys)
        except TransportError:
            pass
        return replies

    def close(self):
        self.pool.shutdown(wait=True)
        self.store.close()


class S3CommitLog(CommitLog):
    """Commit records `{prefix}/commits/v<N>.json`, created with a conditional write."""

    _NAME = re.compile(r"/v(\d{8,})\.json$")

    def __init__(self, t: S3Transport):
        self.t, self.store = t, _Store(t)
        self.base = t.key("commits") + "/"

    def latest(self) -> int:
        return max((int(m.group(1)) for k, _ in self.store.list(self.base) if (m := self._NAME.search(k))),
                   default=0)

    def write(self, info: TransferInfo, extra: dict) -> None:
        key = f"{self.base}v{info.target_version:08d}.json"
        where = f"s3://{self.t.bucket}/{key}"
        if self.store.exists(key):  # stores that ignore If-None-Match still cannot overwrite in sequence
            raise AlreadyCommitted(where)
        deadline = time.monotonic() + self.t.timeout_s
        while True:
            try:
                return self.store.put(key, self.record(info, extra), if_none_match=True)
            except _Exists:
                raise AlreadyCommitted(where) from None
            except _Conflict:  # another conditional write of this key is in progress: its outcome decides
                if time.monotonic() >= deadline:
                    raise TransportError(f"s3 transport ({self.t.where}): commit record {key} stayed in "
                                         f"conflict for {self.t.timeout_s:g} s") from None
                time.sleep(self.t.poll_s)

    def close(self) -> None:
        self.store.close()
