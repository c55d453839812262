"""A local S3-compatible server on loopback, in a process of its own: for the demo
(`nemo-dcr demo --transport s3` without `--s3-endpoint`) and the tests.

`moto_server()` runs moto's S3 server (`python -m moto.server`, from `moto[server]`: the
`demo` extra). It accepts any credentials and does not check upload checksums, unless
started with `enforce_auth=True`: then it checks SigV4 signatures against access keys of
its own IAM (a user with full access is created and its keys returned). `s3_server()`
adds a fresh bucket and yields an S3 transport configuration. Every process is stopped
(and waited for) when the context exits, and dies with its parent (Linux).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """In the child: SIGTERM when the parent dies, even by SIGKILL (Linux), so no server
    outlives the process that started it."""
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
