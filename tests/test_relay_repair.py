"""Relay-tree repair, on real relay processes on 127.0.0.1: when a relay dies (SIGKILL, or
frozen so that it misses its heartbeats), the node above it adopts its children and
re-sends what the dead relay had not acknowledged, so every other receiver stages every
payload bit for bit; the producer's flush names the dead node (and only it) as lost; a
dead root is routed around by the producers themselves; and once the node is started
again (same id and endpoint) the next transfer reaches everyone.

Tree (fanout 2): rx0 -> rx1, rx2; rx1 -> rx3, rx4; rx2 -> rx5, rx6.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest

from nemo_dcr.errors import TransportError
from nemo_dcr.records import TransferInfo
from nemo_dcr.transports.relay import RelayTransport
from tests.support.relay_cluster import RelayCluster

N = 7
TIMEOUT = 12.0  # the cluster's timeout_s: every wait below is bounded by it; far above the
# dead-link grace (reconnect_s, 1 s), so a loaded machine does not make a dead relay look hung


def info(tid: str) -> TransferInfo:
    return TransferInfo(tid, 0, 1, ("p0",))


def blobs_for(tag: str, n: int) -> dict[str, bytes]:
    sizes = [0, 1, 100, 5000, 70000, 300000]
    return {f"{tag}-{i:03d}": os.urandom(sizes[i % len(sizes)]) for i in range(n)}


def digests(blobs: dict[str, bytes]) -> dict[str, tuple[int, str]]:
    return {pid: (len(b), hashlib.blake2b(b, digest_size=16).hexdigest()) for pid, b in blobs.items()}


def staged(cluster: RelayCluster, rx: str) -> dict[str, tuple[int, str]]:
    """payload id -> (size, BLAKE2b) as node rx's receiver got it; a payload may arrive more
    than once (at least once delivery), but always with the same bytes."""
    got: dict[str, tuple[int, str]] = {}
    for kind, pid, size, digest in (e for e in cluster.result(rx)["events"] if e[0] == "payload"):
        assert got.setdefault(pid, (size, digest)) == (size, digest), f"{rx} got two versions of {pid}"
    return got


def send_all(prod, transfer: TransferInfo, blobs: dict[str, bytes]) -> dict:
    for pid, blob in blobs.items():
        prod.send(transfer, pid, blob)
    return prod.flush(transfer, list(blobs))


def expect_lost(prod, transfer: TransferInfo, blobs: dict[str, bytes], lost: list[str], whys: list[str], *,
                send: bool = True, must_lose: dict[str, bytes] | None = None) -> TransportError:
    """Send `blobs` (unless `send` is False: already sent), flush, and check that flush names
    exactly the receivers `lost`, with the reasons `whys`, each for at least the payloads of
    `must_lose` (default: all of `blobs`)."""
    start = time.monotonic()
    with pytest.raises(TransportError) as err:
        send_all(prod, transfer, blobs) if send else prod.flush(transfer, list(blobs))
    elapsed = time.monotonic() - start
    msg = str(err.value)
    assert f"receivers {sorted(lost)} did not stage" in msg and all(why in msg for why in whys), msg
    assert sorted(err.value.lost) == sorted(lost), msg
    assert all(set(err.value.lost[rx]) >= set(blobs if must_lose is None else must_lose) for rx in lost), msg
    assert err.value.rejected == {}, msg
    assert elapsed < TIMEOUT, f"flush took {elapsed:.1f} s to report the dead node"
    return err.value


def check_exits(cluster: RelayCluster, codes: dict) -> None:
    bad = {rx: c for rx, c in codes.items() if c != 0}
    assert not bad, {rx: cluster.log(rx)[-2000:] for rx in bad}


def test_repair_settings_are_checked():
    nodes = [{"id": "rx0", "endpoint": "tcp://127.0.0.1:1"}]
    t = RelayTransport({"nodes": nodes})
    assert (t.reconnect_s, t.heartbeat_s) == (1.0, 5.0)
    with pytest.raises(ValueError, match="reconnect_s must be > 0"):
        RelayTransport({"nodes": nodes, "reconnect_s": 0})
    with pytest.raises(ValueError, match="heartbeat_s must be >= 0"):
        RelayTransport({"nodes": nodes, "heartbeat_s": -1})
    assert RelayTransport({"nodes": nodes, "heartbeat_s": 0}).heartbeat_s == 0


def test_killed_interior_relay_is_routed_around_and_rejoins_when_restarted(tmp_path):
    with RelayCluster(N, tmp_path, timeout_s=TIMEOUT) as cluster:
        prod = cluster.transport().producer("p0")
        try:
            before = blobs_for("t0", 6)
            assert send_all(prod, info("t0"), before) == {}  # the tree is up: rx1 was connected
            cluster.kill_node(1)
            during = blobs_for("t1", 20)
            expect_lost(prod, info("t1"), during, ["rx1"], [f"relay rx1 at {cluster.endpoint(1)} lost its connection"])
            cluster.restart_node(1)
            after = blobs_for("t2", 10)
            assert send_all(prod, info("t2"), after) == {}  # through rx1 again
        finally:
            prod.close()
        check_exits(cluster, cluster.shutdown())
        for rx in cluster.ids:
            want = after if rx == "rx1" else {**before, **during, **after}  # rx1 restarted: a new process
            assert staged(cluster, rx) == digests(want), rx
        root = cluster.result("rx0")["stats"]
        assert root["adopted"] == 1 and root["held_bytes"] == 0, root  # rx3 and rx4 served by rx0 for t1


def test_relay_killed_during_a_transfer_leaves_its_subtree_complete(tmp_path):
    # rx2 stages slowly, so when it is killed the root holds payloads rx2 never acknowledged.
    with RelayCluster(N, tmp_path, timeout_s=TIMEOUT, node_args={2: ["--delay", "0.2"]}) as cluster:
        prod = cluster.transport().producer("p0")
        try:
            blobs = blobs_for("t1", 24)
            first, rest = dict(list(blobs.items())[:8]), dict(list(blobs.items())[8:])
            for pid, blob in first.items():
                prod.send(info("t1"), pid, blob)
            # Kill rx2 only once it staged a payload: its parent's link to it is then up, so
            # the loss is seen as a lost connection, not as a node that never answered.
            deadline = time.monotonic() + TIMEOUT
            while ("t1", next(iter(first))) in prod.in_flight:
                assert time.monotonic() < deadline, "the first payload was never staged everywhere"
                prod._turn(0.05)
            cluster.kill_node(2)
            for pid, blob in rest.items():
                prod.send(info("t1"), pid, blob)
            expect_lost(prod, info("t1"), blobs, ["rx2"], [f"relay rx2 at {cluster.endpoint(2)} lost its connection"],
                        send=False, must_lose=rest)  # rest: sent after rx2 died
            cluster.restart_node(2, args=[])
            after = blobs_for("t2", 6)
            assert send_all(prod, info("t2"), after) == {}
        finally:
            prod.close()
        check_exits(cluster, cluster.shutdown())
        for rx in cluster.ids:
            want = after if rx == "rx2" else {**blobs, **after}
            assert staged(cluster, rx) == digests(want), rx
        root = cluster.result("rx0")["stats"]
        assert root["adopted"] == 1 and root["resent"] >= 1, root  # what rx2 held went to rx5 and rx6


def test_dead_root_is_routed_around_by_the_producer(tmp_path):
    with RelayCluster(N, tmp_path, timeout_s=TIMEOUT) as cluster:
        prod = cluster.transport().producer("p0")
        try:
            before = blobs_for("t0", 4)
            assert send_all(prod, info("t0"), before) == {}
            cluster.kill_node(0)
            during = blobs_for("t1", 12)
            expect_lost(prod, info("t1"), during, ["rx0"],
                        [f"root relay rx0 at {cluster.endpoint(0)} lost its connection"])
            assert prod.stats["adopted"] == 1 and not prod.in_flight
            cluster.restart_node(0)
            after = blobs_for("t2", 6)
            assert send_all(prod, info("t2"), after) == {}
            assert prod.stats["adopted"] == 1  # t2 went to the restarted root, not around it
        finally:
            prod.close()
        check_exits(cluster, cluster.shutdown())
        for rx in cluster.ids:
            want = after if rx == "rx0" else {**before, **during, **after}
            assert staged(cluster, rx) == digests(want), rx
        assert cluster.result("rx0")["stats"]["payloads"] == len(after)


def test_frozen_relay_misses_its_heartbeats_and_is_routed_around(tmp_path):
    # SIGSTOP: the connection stays open, but nothing answers, not even ZMTP pings; like a
    # host that vanished without closing its connections.
    with RelayCluster(N, tmp_path, timeout_s=TIMEOUT, heartbeat_s=0.3) as cluster:
        prod = cluster.transport().producer("p0")
        try:
            before = blobs_for("t0", 4)
            assert send_all(prod, info("t0"), before) == {}  # the tree is up: rx1 was connected
            cluster.signal_node(1, signal.SIGSTOP)
            try:
                during = blobs_for("t1", 10)
                expect_lost(prod, info("t1"), during, ["rx1"],
                            [f"relay rx1 at {cluster.endpoint(1)} lost its connection"])
            finally:
                cluster.signal_node(1, signal.SIGCONT)
            after = blobs_for("t2", 6)
            assert send_all(prod, info("t2"), after) == {}  # thawed: it reconnects and serves again
        finally:
            prod.close()
        check_exits(cluster, cluster.shutdown())
        for rx in cluster.ids:
            got, want = staged(cluster, rx), digests({**before, **during, **after})
            if rx == "rx1":  # it may still have staged some of t1 after thawing; it must have t0 and t2
                assert {pid: got.get(pid) for pid in {**before, **after}} == digests({**before, **after})
                assert got.items() <= want.items()
            else:
                assert got == want, rx


def test_dead_relays_one_below_the_other_are_both_skipped(tmp_path):
    # 10 nodes: rx0 -> rx1 -> rx3 -> rx7, rx8 and rx1 -> rx4 -> rx9. rx3 never comes up;
    # then rx1 dies too, and rx0 serves rx4, rx7 and rx8 itself.
    with RelayCluster(10, tmp_path, timeout_s=TIMEOUT, absent=(3,)) as cluster:
        prod = cluster.transport().producer("p0")
        try:
            first = blobs_for("t0", 6)
            expect_lost(prod, info("t0"), first, ["rx3"],
                        [f"relay rx3 at {cluster.endpoint(3)} did not accept a connection"])  # rx1 adopts rx7, rx8
            cluster.kill_node(1)
            during = blobs_for("t1", 12)
            expect_lost(prod, info("t1"), during, ["rx1", "rx3"],
                        [f"relay rx1 at {cluster.endpoint(1)} lost its connection",
                         f"relay rx3 at {cluster.endpoint(3)} did not accept a connection"])
            cluster.restart_node(1)
            cluster.restart_node(3)  # its first start
            after = blobs_for("t2", 6)
            assert send_all(prod, info("t2"), after) == {}
        finally:
            prod.close()
        check_exits(cluster, cluster.shutdown())
        for rx in cluster.ids:
            want = after if rx in ("rx1", "rx3") else {**first, **during, **after}
            assert staged(cluster, rx) == digests(want), rx
        assert cluster.result("rx0")["stats"]["adopted"] == 2  # rx1, then (for t1) rx3 below it
