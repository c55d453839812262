"""The S3 transport behind a fault-injecting proxy (tests/support/s3_fault_proxy.py) in front
of moto's real S3 server: the proxy is transparent when it injects nothing; with 5xx,
timeouts and resets injected into a share of all requests, transfers and full refits
still arrive bit-exact; a persistent outage fails closed, naming the operation, the object
and the endpoint, within the configured retry budget, with receivers left at their base;
and a retried write that had landed is not mistaken for someone else's (commit records,
multipart completions, control messages). Faults are drawn from a seeded generator."""

from __future__ import annotations

import contextlib
import http.client
import os
import threading
import time

import pytest

from nemo_dcr import registry
from nemo_dcr.commit_log import AlreadyCommitted
from nemo_dcr.errors import TransferFailed, TransportError
from nemo_dcr.records import Op, TransferInfo
from nemo_dcr.verify import bit_mismatches
from tests.support.s3_fault_proxy import Fault, FaultProxy
from tests.support.s3_server import moto_server, payload_objects
from tests.support.transports import run_receivers

# The local refit test's model, trainer and receiver harness; only the transport differs.
from tests.test_local_refit import Setup, checkpoint  # noqa: F401

S3Transport = pytest.importorskip("nemo_dcr.transports.s3", reason="needs boto3").S3Transport
pytest.importorskip("flask", reason="moto's S3 server needs moto[server]")
from nemo_dcr.transports.s3_store import Missing, ObjectStore  # noqa: E402 - after the skip for a missing boto3
pytestmark = pytest.mark.usefixtures("single_rank_group")

INFO = TransferInfo("t1", 0, 1, ("p0",))
MiB = 1 << 20
READ_TIMEOUT_S = 1.0  # per attempt; an injected "timeout" holds the answer longer than this
# A moderate mix over every operation (about 5% of requests): some faults before the server
# sees the request, some after it acted (the client cannot tell whether it took effect).
# Timeouts cost READ_TIMEOUT_S each, so only two: one payload upload (it never reaches the
# server) and one payload download (its answer never comes back).
MODERATE = (Fault("timeout", ops=("PUT",), key="/payloads/", delay_s=READ_TIMEOUT_S + 0.5, limit=1),
            Fault("timeout", ops=("GET",), key="/payloads/", delay_s=READ_TIMEOUT_S + 0.5, after=True, limit=1),
            Fault("503", rate=0.02), Fault("500", rate=0.01, after=True), Fault("reset", rate=0.01),
            Fault("reset", rate=0.01, after=True))


@pytest.fixture(scope="module")
def server():
    with moto_server() as s:
        yield s


@pytest.fixture
def proxy(server):
    with FaultProxy(server.endpoint_url, seed=20240601) as p:
        yield p
    leaked = [t.name for t in threading.enumerate() if t.name == "s3-fault-proxy" or "process_request" in t.name]
    assert leaked == [] and not p._sockets  # every thread joined, every connection closed


def config(server, proxy, **extra) -> dict:
    """A fresh bucket (made directly on the server), reached through the proxy."""
    return server.config(server.new_bucket(), **{"endpoint_url": proxy.url, "poll_s": 0.02, "timeout_s": 20,
                                                  "retry_s": 8, "read_timeout_s": READ_TIMEOUT_S, **extra})


@contextlib.contextmanager
def s3_refit(checkpoint, tmp_path, monkeypatch, proxy, cfg, n_receivers=2):  # noqa: F811
    """tests/test_local_refit.py's Setup (a trainer and Hugging Face receivers on threads)
    over the S3 transport through the proxy; faults are cleared before it is torn down."""
    monkeypatch.setattr(registry, "transport",
                        lambda name, _config=None, *, receivers=None: S3Transport(cfg, receivers=receivers))
    s = Setup(checkpoint, tmp_path, n_receivers=n_receivers, op=Op.XOR)
    try:
        yield s
    finally:
        proxy.clear_faults()
        s.close()


def serving(s, version, timeout_s=15.0) -> None:
    """Receivers learn of a commit at their next poll of the bucket: wait for it."""
    deadline = time.monotonic() + timeout_s
    while any(r.serving_version != version for r in s.receivers) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(th.is_alive() for th in s.threads), "a receiver's loop died"
    assert [r.serving_version for r in s.receivers] == [version] * len(s.receivers)


# --- (a) transparency -----------------------------------------------------------------------

def test_proxy_forwards_transparently(server, proxy):
    cfg = config(server, proxy, part_size=5 * MiB, multipart_threshold=5 * MiB)
    t = S3Transport(cfg, receivers=["rx0"])
    store = ObjectStore(t.s3)
    direct = server.client()
    try:
        small, big = os.urandom(3000), os.urandom(11 * MiB)  # big: three multipart parts
        store.put("dcr/a/small", small)
        store.put("dcr/a/big", big)
        assert store.get("dcr/a/small") == small and store.get("dcr/a/big") == big
        assert sorted(store.list("dcr/a/")) == [("dcr/a/big", len(big)), ("dcr/a/small", len(small))]
        assert store.exists("dcr/a/small") and not store.exists("dcr/a/none")
        # What the server holds is what was sent, metadata included.
        head = direct.head_object(Bucket=cfg["bucket"], Key="dcr/a/big")
        assert head["ETag"].strip('"').endswith("-3") and head["ContentLength"] == len(big)
        assert direct.get_object(Bucket=cfg["bucket"], Key="dcr/a/small")["Body"].read() == small
        # A chunked upload's framing goes through as it is (the server de-chunks it).
        host, port = proxy.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.putrequest("PUT", f"/{cfg['bucket']}/dcr/a/chunked", skip_accept_encoding=True)
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        for piece in (b"one ", b"two ", b"three"):
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        conn.send(b"0\r\n\r\n")
        assert conn.getresponse().status == 200
        conn.close()
        assert direct.get_object(Bucket=cfg["bucket"], Key="dcr/a/chunked")["Body"].read() == b"one two three"
        store.delete(["dcr/a/small", "dcr/a/big", "dcr/a/chunked"])
        assert store.list("dcr/") == []
        counts = proxy.counts()
        assert counts["injected"] == {}
        assert {"PUT", "POST", "GET", "HEAD", "LIST", "DELETE"} <= set(counts["requests"])
    finally:
        store.close()


def test_signatures_still_verify_through_the_proxy():
    """SigV4 signs the Host header: forwarded unchanged, a server that checks signatures
    (moto with auth enforced) accepts what came through the proxy, and still refuses a wrong key."""
    with moto_server(enforce_auth=True) as s, FaultProxy(s.endpoint_url) as p:
        bucket = s.new_bucket()
        t = S3Transport(s.config(bucket, endpoint_url=p.url, timeout_s=5), receivers=["rx0"])
        store = ObjectStore(t.s3)
        try:
            store.put("k/x", b"signed")
            assert store.get("k/x") == b"signed" and store.exists("k/x")
            assert store.list("k") == [("k/x", 6)]  # (moto's auth check mishandles '/' in a query)
        finally:
            store.close()
        bad = S3Transport(s.config(bucket, endpoint_url=p.url, timeout_s=5, secret_key="wrong"), receivers=["rx0"])
        with pytest.raises(TransportError, match="access denied"):
            bad.producer("p0")


# --- (b) convergence under faults -------------------------------------------------------------

def test_transfer_arrives_intact_under_injected_faults(server, proxy):
    t = S3Transport(config(server, proxy, part_size=5 * MiB, multipart_threshold=5 * MiB),
                    receivers=["rx0", "rx1"])
    seen, finish = run_receivers(t, t.receivers)
    coord = t.coordinator()
    prod = t.producer("p0")
    proxy.set_faults(*MODERATE)
    try:
        coord.broadcast("begin", {"transfer_id": "t1", "transfer": INFO.to_json()})
        blobs = {f"p0-{i:03d}": os.urandom(2000 + i) for i in range(20)}
        blobs["p0-big"] = os.urandom(6 * MiB)  # a multipart upload, under faults too
        for pid, blob in blobs.items():
            prod.send(INFO, pid, blob)
        assert prod.flush(INFO, list(blobs)) == {}
        for rx in t.receivers:
            got = {pid: data for pid, data in seen[rx] if isinstance(data, bytes)}
            assert got == blobs, rx
            assert [k for k, _ in seen[rx]].count("begin") == 1  # no control message twice
        log = t.commit_log("")
        log.write(INFO, {"receivers": t.receivers})
        assert log.latest() == 1
        coord.broadcast("commit", {"transfer_id": "t1", "version": 1})
        injected = proxy.counts()["injected"]
        assert set(injected) == {"500", "503", "reset", "timeout"}, injected
        proxy.clear_faults()
        assert payload_objects(t) == []  # every staged payload was deleted, retries or not
        log.close()
    finally:
        proxy.clear_faults()
        prod.close()
        coord.close()
        finish()
        t.cleanup()


def test_refits_converge_bit_exact_under_injected_faults(checkpoint, tmp_path, monkeypatch, server,  # noqa: F811
                                                         proxy):
    with s3_refit(checkpoint, tmp_path, monkeypatch, proxy, config(server, proxy)) as s:
        proxy.set_faults(*MODERATE, seed=7)
        for version in (1, 2):
            s.step()
            result = s.refit.refit()
            assert result.decision.committed and result.decision.version == version
            assert s.refit.baseline.version == version
            serving(s, version)
            for r in s.receivers:
                assert bit_mismatches(s.expected(), r.runtime.canonical_state()) == []
        injected = proxy.counts()["injected"]
        assert sum(injected.values()) >= 10 and set(injected) == {"500", "503", "reset", "timeout"}, injected


# --- (c) persistent outages fail closed -------------------------------------------------------

def test_persistent_put_outage_fails_closed_naming_operation_object_and_endpoint(server, proxy):
    cfg = config(server, proxy, retry_s=1.0, max_attempts=1)  # the store's retries only: quick to give up
    t = S3Transport(cfg, receivers=["rx0"])
    end = t.receiver("rx0")
    prod = t.producer("p0")
    try:
        proxy.set_faults(Fault("503", ops=("PUT",)))
        start = time.monotonic()
        with pytest.raises(TransportError) as e:
            prod.send(INFO, "p0-0", b"abc")
        elapsed = time.monotonic() - start
        msg = str(e.value)
        assert "writing nemo-dcr/active/t1" in msg and "SlowDown (HTTP 503)" in msg and "retry_s=1" in msg
        assert proxy.url in msg and cfg["bucket"] in msg
        assert 1.0 <= elapsed < 1.0 + 1, elapsed  # the retry budget, then out: no hang
        proxy.clear_faults()
        assert payload_objects(t) == []
    finally:
        proxy.clear_faults()
        prod.close()
        end.close()
        t.cleanup()


def test_unreachable_store_mid_transfer_fails_closed(server, proxy):
    cfg = config(server, proxy, retry_s=1.0, max_attempts=1)
    t = S3Transport(cfg, receivers=["rx0"])
    end = t.receiver("rx0")
    assert end.poll(0.1) is None
    proxy.stop()  # the endpoint is gone: connections are refused
    start = time.monotonic()
    try:
        with pytest.raises(TransportError, match=r"listing nemo-dcr/control/rx0/: cannot reach the endpoint") as e:
            end.poll(1)
        assert proxy.url in str(e.value) and 1.0 <= time.monotonic() - start < 1.0 + 1
    finally:
        end.close()  # its presence object stays behind: the store is gone


def test_refit_during_a_put_outage_fails_closed_and_receivers_stay_at_base(checkpoint, tmp_path,  # noqa: F811
                                                                           monkeypatch, server, proxy):
    cfg = config(server, proxy, retry_s=1.0, max_attempts=1)  # the store's retries only: quick to give up
    with s3_refit(checkpoint, tmp_path, monkeypatch, proxy, cfg, n_receivers=1) as s:
        at_base = {k: v.clone() for k, v in s.expected().items()}  # version 0: the checkpoint
        s.step()
        proxy.set_faults(Fault("503", ops=("PUT",)))
        start = time.monotonic()
        with pytest.raises(TransferFailed, match=r"writing nemo-dcr/control/rx0/\d+\.json: SlowDown") as e:
            s.refit.refit()
        # Every attempt's begin, and the final abort, gives up after retry_s.
        assert time.monotonic() - start < (s.refit.max_attempts + 1) * (1.0 + 1.0), str(e.value)
        assert s.refit.baseline.version == 0
        assert s.receivers[0].serving_version == 0
        assert bit_mismatches(at_base, s.receivers[0].runtime.canonical_state()) == []
        proxy.clear_faults()  # the store is back: the next refit commits, bit-exact
        result = s.refit.refit()
        assert result.decision.committed and result.decision.version == 1
        serving(s, 1)
        assert bit_mismatches(s.expected(), s.receivers[0].runtime.canonical_state()) == []


# --- (d) retries of writes that had landed --------------------------------------------------

@pytest.mark.parametrize("kind", ["503", "reset", "timeout"])
def test_commit_record_whose_first_write_landed_is_not_already_committed(server, proxy, kind):
    t = S3Transport(config(server, proxy), receivers=["rx0"])
    log, rival = t.commit_log(""), t.commit_log("")
    try:
        # The record is written; its answer is lost; the retry's If-None-Match gets 412.
        proxy.set_faults(Fault(kind, ops=("PUT",), key=r"/commits/v\d+\.json$", after=True, limit=1,
                               delay_s=READ_TIMEOUT_S + 0.5))
        log.write(INFO, {"receivers": ["rx0"]})
        assert proxy.counts()["injected"] == {kind: 1}
        assert log.latest() == 1
        # Another coordinator's record for the same version is still refused.
        with pytest.raises(AlreadyCommitted, match="v00000001.json"):
            rival.write(INFO, {"receivers": ["rx0"]})
    finally:
        proxy.clear_faults()
        log.close()
        rival.close()
        t.cleanup()


def test_rival_commit_record_is_refused_when_its_412_was_lost(server, proxy):
    t = S3Transport(config(server, proxy), receivers=["rx0"])
    log, rival = t.commit_log(""), t.commit_log("")
    try:
        log.write(INFO, {"receivers": ["rx0"]})
        rival.store.exists = lambda key: False  # past the HEAD check, to the conditional create
        # The server refuses the rival's create (412); that answer is lost; the retry gets 412 too.
        proxy.set_faults(Fault("reset", ops=("PUT",), key=r"/commits/", after=True, limit=1))
        with pytest.raises(AlreadyCommitted, match="v00000001.json"):
            rival.write(INFO, {"receivers": ["rx0"]})
        assert proxy.counts()["injected"] == {"reset": 1}
    finally:
        proxy.clear_faults()
        log.close()
        rival.close()
        t.cleanup()


def test_store_retries_what_botocore_does_not(server, proxy):
    """A body cut off mid-read, and a multipart completion whose answer was lost."""
    t = S3Transport(config(server, proxy, part_size=5 * MiB, multipart_threshold=5 * MiB), receivers=["rx0"])
    store = ObjectStore(t.s3)
    try:
        blob = os.urandom(6 * MiB)
        # The completion takes effect, its answer is cut off, botocore completes again (moto
        # answers that with success; S3 may answer NoSuchUpload, which the store checks).
        proxy.set_faults(Fault("reset", ops=("POST",), key="big", query="uploadId", after=True, limit=1))
        store.put("dcr/big", blob)
        assert server.client().head_object(Bucket=t.bucket, Key="dcr/big")["ETag"].strip('"').endswith("-2")
        # botocore hands over a body still streaming: a reset there is the store's to retry.
        proxy.set_faults(Fault("reset", ops=("GET",), key="big", after=True, limit=2))
        assert store.get("dcr/big") == blob
        assert proxy.counts()["injected"] == {"reset": 3}
        assert server.client().list_multipart_uploads(Bucket=t.bucket).get("Uploads", []) == []
        # An error answer (here 404) is read by botocore outside the code that wraps urllib3's
        # errors: cut off, it reaches the store as urllib3's ProtocolError, retried all the same.
        proxy.set_faults(Fault("reset", ops=("GET",), key="absent", after=True, limit=1))
        with pytest.raises(Missing):
            store.get("dcr/absent")
        assert proxy.counts()["injected"] == {"reset": 4}
    finally:
        proxy.clear_faults()
        store.close()
        t.cleanup()


def test_control_message_brought_back_by_a_retry_is_delivered_once(server, proxy):
    t = S3Transport(config(server, proxy), receivers=["rx0"])
    end = t.receiver("rx0")
    coord = t.coordinator()
    try:
        # The begin lands at once; its answer is held past the read timeout, so it is written
        # again after the receiver has read and deleted the first copy.
        proxy.set_faults(Fault("timeout", ops=("PUT",), key="/control/", after=True, limit=1,
                               delay_s=READ_TIMEOUT_S + 0.5))
        sender = threading.Thread(target=coord.broadcast, args=("begin", {"transfer_id": "t1"}))
        sender.start()
        kinds, deadline = [], None
        while deadline is None or time.monotonic() < deadline:
            ev = end.poll(0.05)
            if ev is not None:
                kinds.append(ev.kind)
            if deadline is None and not sender.is_alive():  # the second copy is written: watch a while
                deadline = time.monotonic() + 0.5
        sender.join()
        assert proxy.counts()["injected"] == {"timeout": 1}
        assert kinds == ["begin"]
        assert [k for k, _ in end.store.list(end.inbox)] == []  # the second copy was removed too
    finally:
        proxy.clear_faults()
        coord.close()
        end.close()
        t.cleanup()
