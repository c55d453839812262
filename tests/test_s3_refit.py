"""Refits over the S3 transport (moto's S3 server on loopback) into real Hugging Face
receivers on threads: the same end-to-end check as
tests/test_local_refit.py::test_refits_are_bit_exact_and_commit_jointly, with every
payload, manifest, ack, control message and commit record going through the bucket."""

from __future__ import annotations


import pytest

from nemo_dcr import registry
from nemo_dcr.records import Op
from nemo_dcr.verify import bit_mismatches
from tests.support.wait import serving
from tests.support.s3_server import moto_server

# The local refit test's model, process group and trainer/receiver harness; only the
# transport differs (Setup builds it through registry.transport, redirected below).
from tests.test_local_refit import Setup, checkpoint  # noqa: F401

S3Transport = pytest.importorskip("nemo_dcr.transports.s3", reason="needs boto3").S3Transport
pytest.importorskip("flask", reason="moto's S3 server needs moto[server]")
pytestmark = pytest.mark.usefixtures("single_rank_group")


@pytest.fixture(scope="module")
def server():
    with moto_server() as s:
        yield s


def test_refits_over_s3_are_bit_exact_and_commit_jointly(checkpoint, tmp_path, server, monkeypatch):  # noqa: F811
    bucket = server.new_bucket()
    config = server.config(bucket, timeout_s=20, poll_s=0.02)
    monkeypatch.setattr(registry, "transport",
                        lambda name, _config=None, *, receivers=None: S3Transport(config, receivers=receivers))
    s = Setup(checkpoint, tmp_path, n_receivers=2, op=Op.XOR)
    assert isinstance(s.transport, S3Transport)
    s3 = server.client()
    try:
        for version in (1, 2, 3):
            s.step()
            result = s.refit.refit()
            assert result.decision.committed and result.decision.version == version
            assert s.refit.baseline.version == version
            assert 0 < result.changed_elements < result.scanned_elements
            assert result.metrics()["payloads"] > 1  # streamed in several payloads
            serving(s.receivers, version)  # receivers learn of the commit at their next poll of the bucket
            for r in s.receivers:
                assert bit_mismatches(s.expected(), r.runtime.canonical_state()) == []
            # Between refits the bucket holds the commit records and the receivers' presence
            # (and control messages not yet read); payloads, acks, manifests and replies are gone.
            keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", ())]
            assert [k for k in keys if not k.startswith("nemo-dcr/control/")] == [
                f"nemo-dcr/commits/v{v:08d}.json" for v in range(1, version + 1)] + [
                "nemo-dcr/receivers/rx0.json", "nemo-dcr/receivers/rx1.json"]
        assert s.refit.coordinator.log.latest() == 3
        assert not (tmp_path / "state" / "commits").exists()  # the records live in the bucket
    finally:
        s.close()
    assert s3.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0  # cleanup() emptied the prefix
