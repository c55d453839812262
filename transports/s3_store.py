"""The S3 store under the s3 transport: one bucket, reached with boto3, seen as checked objects.

`S3Bucket` is where the objects live and how to reach them (one per transport): it builds
clients, checks the bucket once and turns botocore's errors into a TransportError naming the
endpoint and bucket. `ObjectStore` is one client of it (one per end) with the operations the
ends need: checksummed put/get, conditional create, multipart upload, listing, deleting.

- Integrity: every object is written with its SHA-256 as the S3 checksum (checked by the
  server; per part for multipart uploads) and as user metadata `sha256` of the whole object.
  Reads ask for the server's checksum (`ChecksumMode=ENABLED`, checked by botocore) and always
  check length and `sha256` themselves (botocore skips composite multipart checksums). A
  mismatch in three reads is a `Corrupt` TransportError naming the object.
- Retries, in two layers. botocore's "standard" mode makes `max_attempts` attempts of each
  call. Around that, every operation retries transient failures (HTTP 500/502/503/504,
  throttling, connect and read timeouts, connections reset or closed, bodies cut off
  mid-read, which botocore does not retry) with jittered exponential backoff until `retry_s`
  have passed since it started; then it fails closed with a TransportError naming the
  operation, the object, the endpoint and the bucket. One attempt waits at most
  `connect_timeout_s` to connect and `read_timeout_s` for each read, so an operation never
  takes much longer than retry_s + one call (max_attempts x (connect_timeout_s +
  read_timeout_s), plus botocore's backoff of up to 2^(attempt-1) s between its attempts).
  Other errors (missing object, refused credentials, a bad checksum) are not retried.
- Retries of writes that took effect: a retry may repeat a write whose answer was lost. Plain
  puts and deletes are idempotent; a conditional create answers 412 (`Exists`: the caller
  compares what is stored with what it wrote); completing a multipart upload that an earlier
  try completed answers NoSuchUpload, and counts as done when the object is there with this
  upload's length and `sha256`. A multipart upload whose start was retried may leave an
  unfinished upload behind (`abort_uploads` removes it).
- The bucket check retries transient failures until `timeout_s`, each try with one attempt;
  connecting never takes a large share of timeout_s, so an unreachable endpoint fails in time.
- Credentials: the standard AWS chain (environment, files, instance roles, `profile`) or
  access_key / secret_key / session_token; never logged (neither `where` nor any error
  message shows them).
"""

from __future__ import annotations

import base64
import hashlib
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from nemo_dcr.errors import TransportError
from nemo_dcr.transport import loads

try:
    import boto3
    from botocore import exceptions as bex
    from botocore.config import Config
    from urllib3 import exceptions as urllib3_errors
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError("the s3 transport needs boto3: pip install 'nemo-dcr[s3]'") from e

_READS = 3  # reads of an object before a checksum mismatch is final
_SESSIONS: dict = {}
_SESSION_LOCK = threading.Lock()
_TRANSIENT_STATUS = (500, 502, 503, 504)
_TRANSIENT_CODES = ("SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling",
                    "ThrottlingException", "RequestLimitExceeded")
# No answer, or half of one: timeouts, refused / reset / closed connections, bodies cut off.
# botocore reads a small response's body (an error's, for one) outside the code that wraps
# urllib3's errors, so a connection reset there reaches the caller as urllib3's own.
_TRANSIENT_ERRORS = (bex.HTTPClientError, bex.ConnectionError, bex.IncompleteReadError, urllib3_errors.HTTPError)
# What an S3 call raises that `transient` judges.
_CALL_ERRORS = (bex.ClientError, bex.BotoCoreError, urllib3_errors.HTTPError)
_UNREACHABLE = (bex.EndpointConnectionError, bex.ConnectTimeoutError)
_BACKOFF_S = (0.05, 2.0)  # first and longest pause between retries of one operation


def _sha256(data) -> bytes:
    return hashlib.sha256(data).digest()


def _status(e: bex.ClientError):
    return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _code(e: bex.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def transient(e: Exception) -> bool:
    """Whether botocore's (or urllib3's) error `e` may go away when the request is made again."""
    if isinstance(e, bex.ClientError):
        return _status(e) in _TRANSIENT_STATUS or _code(e) in _TRANSIENT_CODES
    return isinstance(e, _TRANSIENT_ERRORS)


class Missing(Exception):
    """The object does not exist (any more)."""


class Exists(Exception):
    """A conditional create found the object already there (HTTP 412)."""


class Conflict(Exception):
    """A concurrent conditional write is in progress (HTTP 409): try again."""


class Corrupt(TransportError):
    """An object failed its checksum in every read."""


class S3Bucket:
    """One bucket at one endpoint, and how to reach it, shared by every ObjectStore of a transport.

    `config` holds the transport's settings: bucket, endpoint_url, region, profile,
    addressing_style, max_attempts and the optional access_key / secret_key / session_token.
    Uploads of `multipart_threshold` bytes or more go up in `part_size` parts,
    `upload_concurrency` at a time; clients keep `pool_connections` connections. Timeouts and
    retries: see the module docstring (connect/read timeouts default to a share of timeout_s,
    retry_s to timeout_s).
    """

    def __init__(self, config: dict, *, timeout_s: float, part_size: int, multipart_threshold: int,
                 upload_concurrency: int, pool_connections: int, retry_s: float | None = None,
                 connect_timeout_s: float | None = None, read_timeout_s: float | None = None):
        self.config, self.name = config, str(config["bucket"])
        self.timeout_s, self.part_size, self.multipart_threshold = timeout_s, part_size, multipart_threshold
        self.retry_s = timeout_s if retry_s is None else float(retry_s)
        # Connecting never takes a large share of timeout_s: an unreachable endpoint fails in time;
        # one stalled read leaves room for retries within retry_s.
        self.connect_timeout_s = float(min(max(timeout_s / 4, 1.0), 10.0) if connect_timeout_s is None
                                       else connect_timeout_s)
        self.read_timeout_s = float(min(timeout_s, 60.0) if read_timeout_s is None else read_timeout_s)
        if self.retry_s < 0 or self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError(f"s3 transport: need retry_s >= 0 and connect_timeout_s, read_timeout_s > 0; got "
                             f"{self.retry_s:g}, {self.connect_timeout_s:g}, {self.read_timeout_s:g}")
        self.upload_concurrency, self.pool_connections = upload_concurrency, pool_connections
        endpoint = config["endpoint_url"] or f"AWS S3 ({config['region'] or 'default region'})"
        self.where = f"endpoint {endpoint}, bucket {self.name}"  # names the store in every error
        self._checked = False

    def __repr__(self):  # never shows credentials
        return f"S3Bucket({self.where})"

    def client(self, max_attempts: int | None = None):
        c = self.config
        with _SESSION_LOCK:  # one session per profile: clients share its loaded models (fast to make)
            session = _SESSIONS.get(c.get("profile"))
            if session is None:
                session = _SESSIONS[c.get("profile")] = boto3.session.Session(profile_name=c.get("profile"))
        region = c["region"] or session.region_name or ("us-east-1" if c["endpoint_url"] else None)
        style = c["addressing_style"] or ("path" if c["endpoint_url"] else "auto")
        cfg = Config(connect_timeout=self.connect_timeout_s, read_timeout=self.read_timeout_s,
                     # botocore's own "max_attempts" counts retries only: ours counts every attempt.
                     retries={"mode": "standard", "total_max_attempts": int(max_attempts or c["max_attempts"])},
                     max_pool_connections=self.pool_connections, s3={"addressing_style": style})
        with _SESSION_LOCK:  # sessions are not thread-safe
            return session.client("s3", endpoint_url=c["endpoint_url"] or None, region_name=region, config=cfg,
                                  aws_access_key_id=c.get("access_key"), aws_secret_access_key=c.get("secret_key"),
                                  aws_session_token=c.get("session_token"))

    def check(self) -> None:
        """Fail with a clear error, within timeout_s, if the bucket cannot be used."""
        if self._checked:
            return
        s3 = self.client(max_attempts=1)
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                try:
                    s3.head_bucket(Bucket=self.name)
                    self._checked = True
                    return
                except _CALL_ERRORS as e:
                    if not transient(e):
                        raise self.error(e, "checking the bucket") from None
                    if time.monotonic() + 0.2 >= deadline:
                        if isinstance(e, _UNREACHABLE):
                            raise TransportError(f"s3 transport ({self.where}): cannot reach the endpoint "
                                                 f"within {self.timeout_s:g} s: {e}") from None
                        raise self.error(e, "checking the bucket", f"still failing after {self.timeout_s:g} s") \
                            from None
                    time.sleep(0.2)
        finally:
            s3.close()

    def error(self, e: Exception, doing: str, note: str = "") -> TransportError:
        """botocore's error `e`, met while `doing` something, as a TransportError naming the store."""
        if isinstance(e, bex.ClientError):
            err = e.response.get("Error", {})
            code, status = str(err.get("Code", "?")), _status(e)
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
            why = f"the endpoint did not answer within {self.read_timeout_s:g} s (read_timeout_s)"
        else:
            why = f"{type(e).__name__}: {e}"
        return TransportError(f"s3 transport ({self.where}): {doing}: {why}" + (f" ({note})" if note else ""))


class ObjectStore:
    """One S3 client of a checked bucket and the object operations every end needs, with
    checksums, retries and errors (a TransportError naming the operation, the object, the
    endpoint and the bucket; `Missing`, `Exists` and `Conflict` where the caller decides).
    Close it when done."""

    def __init__(self, bucket: S3Bucket):
        bucket.check()
        self.at, self.bucket = bucket, bucket.name
        self.s3 = bucket.client()

    def _call(self, doing: str, fn, /, **kw):
        """fn(**kw), made again while it fails transiently, until retry_s have passed since the
        first try; then a TransportError naming `doing` and the store. Other botocore errors
        go to the caller as they are."""
        start, pause, tries = time.monotonic(), _BACKOFF_S[0], 0
        while True:
            tries += 1
            try:
                return fn(**kw)
            except _CALL_ERRORS as e:
                if not transient(e):
                    raise
                spent = time.monotonic() - start
                if spent >= self.at.retry_s:
                    raise self.at.error(e, doing, f"still failing after {tries} tries in {spent:.1f} s; "
                                                  f"retry_s={self.at.retry_s:g}") from None
                # Jitter: peers that failed together spread out; the last try comes at retry_s.
                time.sleep(min(pause * random.uniform(0.5, 1.0), self.at.retry_s - spent))
                pause = min(2 * pause, _BACKOFF_S[1])

    def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        digest = _sha256(data)
        meta = {"sha256": digest.hex()}
        try:
            if len(data) >= self.at.multipart_threshold and not if_none_match:
                return self._put_parts(key, data, digest, meta)
            extra = {"IfNoneMatch": "*"} if if_none_match else {}
            self._call(f"writing {key}", self.s3.put_object, Bucket=self.bucket, Key=key, Body=data, Metadata=meta,
                       ChecksumAlgorithm="SHA256", ChecksumSHA256=base64.b64encode(digest).decode(), **extra)
        except (bex.ClientError, bex.BotoCoreError) as e:
            status = _status(e) if if_none_match and isinstance(e, bex.ClientError) else None
            if status == 412:  # there already; maybe by an earlier try of this very call (see the docstring)
                raise Exists(key) from None
            if status == 409:
                raise Conflict(key) from None
            raise self.at.error(e, f"writing {key}") from None

    def _put_parts(self, key: str, data: bytes, digest: bytes, meta: dict) -> None:
        size = self.at.part_size
        up = self._call(f"starting the multipart upload of {key}", self.s3.create_multipart_upload,
                        Bucket=self.bucket, Key=key, Metadata=meta, ChecksumAlgorithm="SHA256")
        uid = up["UploadId"]

        def part(n: int) -> dict:
            chunk = data[n * size:(n + 1) * size]
            checksum = base64.b64encode(_sha256(chunk)).decode()
            r = self._call(f"writing part {n + 1} of {key}", self.s3.upload_part, Bucket=self.bucket, Key=key,
                           UploadId=uid, PartNumber=n + 1, Body=chunk, ChecksumAlgorithm="SHA256",
                           ChecksumSHA256=checksum)
            return {"PartNumber": n + 1, "ETag": r["ETag"], "ChecksumSHA256": checksum}

        count = -(-len(data) // size)
        try:
            with ThreadPoolExecutor(min(count, self.at.upload_concurrency)) as pool:
                parts = list(pool.map(part, range(count)))
            try:
                self._call(f"completing the multipart upload of {key}", self.s3.complete_multipart_upload,
                           Bucket=self.bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": parts})
            except bex.ClientError as e:
                # A retry of a completion that took effect (its answer lost) finds no upload any more.
                if _code(e) != "NoSuchUpload" or not self._landed(key, digest, len(data)):
                    raise
        except BaseException:
            try:
                self.s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=uid)
            except (bex.ClientError, bex.BotoCoreError):
                pass  # cleanup() aborts what is left
            raise

    def _landed(self, key: str, digest: bytes, size: int) -> bool:
        """Whether `key` holds the object whose SHA-256 is `digest` (by its metadata)."""
        try:
            r = self._call(f"reading {key}", self.s3.head_object, Bucket=self.bucket, Key=key)
        except bex.ClientError:
            return False
        return r.get("ContentLength") == size and r.get("Metadata", {}).get("sha256") == digest.hex()

    def _fetch(self, key: str):
        # The body is read here, inside the retried call: botocore does not retry a body cut off mid-read.
        r = self.s3.get_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
        return r, r["Body"].read()

    def get(self, key: str) -> bytes:
        problem = ""
        for _ in range(_READS):
            try:
                r, body = self._call(f"reading {key}", self._fetch, key=key)
            except bex.FlexibleChecksumError as e:
                problem = f"S3 checksum mismatch ({e})"
                continue
            except (bex.ClientError, bex.BotoCoreError) as e:
                if isinstance(e, bex.ClientError) and _code(e) in ("NoSuchKey", "404"):
                    raise Missing(key) from None
                raise self.at.error(e, f"reading {key}") from None
            want = r.get("Metadata", {}).get("sha256")
            if want is None:
                raise Corrupt(f"s3 transport ({self.at.where}): object {key} carries no sha256 checksum")
            if len(body) != r.get("ContentLength", len(body)) or _sha256(body).hex() != want:
                problem = f"content ({len(body)} bytes) does not match its SHA-256 checksum"
                continue
            return body
        raise Corrupt(f"s3 transport ({self.at.where}): object {key} failed its checksum in {_READS} reads: {problem}")

    def get_json(self, key: str) -> dict | None:
        """A small control object, or None when it is gone or is not a message of ours (a peer
        waiting for it then times out naming its sender). A store that cannot be read is a
        TransportError: a message that exists is never taken for one that does not."""
        try:
            raw = self.get(key)
        except (Missing, Corrupt):
            return None
        try:
            return loads(raw)
        except TransportError:  # malformed
            return None

    def exists(self, key: str) -> bool:
        try:
            self._call(f"reading {key}", self.s3.head_object, Bucket=self.bucket, Key=key)
            return True
        except (bex.ClientError, bex.BotoCoreError) as e:
            if isinstance(e, bex.ClientError) and _status(e) == 404:
                return False
            raise self.at.error(e, f"reading {key}") from None

    def list(self, prefix: str) -> list[tuple[str, int]]:
        """(key, size) of every object under `prefix`."""
        out, kw = [], {}
        try:
            while True:
                r = self._call(f"listing {prefix}", self.s3.list_objects_v2, Bucket=self.bucket, Prefix=prefix, **kw)
                out += [(o["Key"], int(o["Size"])) for o in r.get("Contents", ())]
                if not r.get("IsTruncated"):
                    return out
                kw = {"ContinuationToken": r["NextContinuationToken"]}
        except (bex.ClientError, bex.BotoCoreError) as e:
            raise self.at.error(e, f"listing {prefix}") from None

    def delete(self, keys) -> None:
        keys = list(keys)
        try:
            for i in range(0, len(keys), 1000):
                batch = keys[i:i + 1000]
                r = self._call(f"deleting {batch[0]}" + (f" and {len(batch) - 1} more" if len(batch) > 1 else ""),
                               self.s3.delete_objects, Bucket=self.bucket,
                               Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
                if r.get("Errors"):
                    err = r["Errors"][0]
                    raise TransportError(f"s3 transport ({self.at.where}): deleting {err.get('Key')}: "
                                         f"{err.get('Code')}: {err.get('Message', '')} "
                                         f"(and {len(r['Errors']) - 1} more)")
        except (bex.ClientError, bex.BotoCoreError) as e:
            raise self.at.error(e, f"deleting {len(keys)} object(s)") from None

    def discard(self, keys) -> None:
        """Delete where possible: leftovers are small, and cleanup() removes them."""
        try:
            self.delete(keys)
        except TransportError:
            pass

    def delete_prefix(self, prefix: str, keep=lambda key: False) -> None:
        self.delete(k for k, _ in self.list(prefix) if not keep(k))

    def abort_uploads(self, prefix: str) -> None:
        """Abort the unfinished multipart uploads under `prefix`."""
        kw: dict = {}
        doing = f"aborting multipart uploads under {prefix}"
        try:
            while True:
                r = self._call(doing, self.s3.list_multipart_uploads, Bucket=self.bucket, Prefix=prefix, **kw)
                for u in r.get("Uploads", ()):
                    try:
                        self._call(doing, self.s3.abort_multipart_upload, Bucket=self.bucket, Key=u["Key"],
                                   UploadId=u["UploadId"])
                    except bex.ClientError as e:
                        if _code(e) != "NoSuchUpload":  # gone already (a retried abort that took effect)
                            raise
                if not r.get("IsTruncated"):
                    return
                kw = {"KeyMarker": r["NextKeyMarker"], "UploadIdMarker": r["NextUploadIdMarker"]}
        except (bex.ClientError, bex.BotoCoreError) as e:
            raise self.at.error(e, doing) from None

    def close(self) -> None:
        self.s3.close()
