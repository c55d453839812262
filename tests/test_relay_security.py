"""The relay tree encrypted and authenticated with ZeroMQ CURVE: payloads and control
flow between key holders, while a peer without the key (plain or with another key
pair) gets nothing in; and a network endpoint bound without authentication warns."""

from __future__ import annotations

import time
import warnings

import pytest
import zmq

from nemo_dcr.cli import main as cli
from nemo_dcr.records import TransferInfo
from nemo_dcr.transport import dumps
from nemo_dcr.transports.relay import RelayTransport, curve_keys
from nemo_dcr.transports.relay_node import is_loopback
from tests.support.launch import free_port
from tests.support.relay_cluster import RelayCluster

INFO = TransferInfo("t1", 0, 1, ("p0",))
ENV = "NEMO_DCR_TEST_CURVE_SECRET"


@pytest.fixture
def curve_secret(monkeypatch):
    _, secret = zmq.curve_keypair()
    monkeypatch.setenv(ENV, secret.decode())
    return secret


def test_curve_key_errors_name_the_variable(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ValueError, match=f"{ENV} must hold a 40-character Z85 CURVE secret key .* it is unset"):
        curve_keys(ENV)
    monkeypatch.setenv(ENV, "short")
    with pytest.raises(ValueError, match="it is 5 characters long"):
        curve_keys(ENV)
    assert curve_keys(None) is None


def test_keygen_prints_a_usable_secret(capsys, monkeypatch):
    assert cli(["curve-keygen"]) == 0
    secret = capsys.readouterr().out.strip().splitlines()[-1]
    monkeypatch.setenv(ENV, secret)
    public, got = curve_keys(ENV)
    assert got == secret.encode() and public == zmq.curve_public(secret.encode())


def intruder(endpoint: str, frames: list[list[bytes]], keys: tuple[bytes, bytes] | None) -> None:
    """Connect to a node like a producer would and push `frames`, with or without CURVE."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        server_public, (public, secret) = keys[0], keys[1]
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server_public, public, secret
    s.connect(endpoint)
    for f in frames:
        try:
            s.send_multipart(f, zmq.NOBLOCK)
        except zmq.Again:
            pass  # no handshake: nothing can be queued (what we want)
    time.sleep(0.5)
    s.close(0)
    ctx.term()


def test_without_curve_anyone_who_reaches_a_node_can_command_it(tmp_path):
    # the attack the CURVE tests below shut out: a forged shutdown stops a plain node
    with RelayCluster(1, tmp_path) as cluster:
        intruder(cluster.endpoint(0), [[dumps({"kind": "shutdown"})]], None)
        assert cluster.wait(10) == {"rx0": 0}
        assert [e[0] for e in cluster.result("rx0")["events"]] == ["shutdown"]


def test_key_holders_talk_and_others_get_nothing_in(tmp_path, curve_secret):
    with RelayCluster(3, tmp_path, curve_secret_env=ENV) as cluster:
        root = cluster.endpoint(0)
        forged_manifest = [dumps({"kind": "manifest", "transfer_id": "t1", "producer_id": "p0",
                                       "payload_ids": ["evil"]})]
        forged_control = [dumps({"kind": "shutdown"})]
        intruder(root, [forged_manifest, forged_control], None)  # plain TCP, no CURVE
        other_public, other_secret = zmq.curve_keypair()
        server_public = zmq.curve_public(curve_secret)
        intruder(root, [forged_manifest, forged_control], (server_public, (other_public, other_secret)))
        prod = cluster.transport().producer("p0")
        try:
            prod.send(INFO, "p0-0", b"x" * 1000)
            assert prod.flush(INFO, ["p0-0"]) == {}
        finally:
            prod.close()
        assert cluster.shutdown() == {rx: 0 for rx in cluster.ids}
        for rx in cluster.ids:
            events = cluster.result(rx)["events"]
            kinds = [e[0] for e in events]
            assert kinds == ["payload", "manifest", "shutdown"], (rx, kinds)
            manifest = next(e[1] for e in events if e[0] == "manifest")
            assert manifest["payload_ids"] == ["p0-0"]


def test_a_node_without_the_key_cannot_join(tmp_path, curve_secret, monkeypatch):
    with RelayCluster(1, tmp_path, curve_secret_env=ENV) as cluster:
        config = dict(cluster.config)
        config.pop("curve_secret_env")  # a producer that was not given the key
        prod = RelayTransport({**config, "timeout_s": 1}).producer("p0")
        try:
            with pytest.raises(Exception, match="root relay rx0"):
                prod.send(INFO, "p0-0", b"x")
                prod.flush(INFO, ["p0-0"])
        finally:
            prod.close()
        assert cluster.shutdown() == {"rx0": 0}
        assert [e[0] for e in cluster.result("rx0")["events"]] == ["shutdown"]


@pytest.mark.parametrize("endpoint,loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.2.1:1", True), ("tcp://localhost:5", True),
    ("tcp://[::1]:5", True), ("tcp://0.0.0.0:5555", False), ("tcp://10.1.2.3:5555", False),
    ("tcp://node7.cluster:5555", False),
])
def test_which_endpoints_count_as_exposed(endpoint, loopback):
    assert is_loopback(endpoint) is loopback


def test_binding_an_exposed_endpoint_without_curve_warns():
    port = free_port()
    t = RelayTransport({"nodes": [{"id": "rx0", "endpoint": f"tcp://127.0.0.1:{port}"}],
                        "coordinator": f"tcp://127.0.0.1:{free_port()}",
                        "coordinator_bind": f"tcp://0.0.0.0:{free_port()}", "timeout_s": 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        coord = t.coordinator()
        coord.close()
    assert any("WITHOUT authentication" in str(w.message) and "curve_secret_env" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loopback: no warning
        t2 = RelayTransport({"nodes": t.nodes, "coordinator": f"tcp://127.0.0.1:{free_port()}", "timeout_s": 2})
        t2.coordinator().close()
