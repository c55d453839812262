"""The relay-tree transport: relays as real processes on 127.0.0.1, real ZeroMQ sockets,
and a bit-exact refit into real Hugging Face receivers (`nemo-dcr receive` processes)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from nemo_dcr import registry
from nemo_dcr.errors import TransportError
from nemo_dcr.records import TransferInfo
from nemo_dcr.transports.relay import RelayTransport, nodes_from_mpi
from tests.support.launch import free_port, worker_env
from tests.support.relay_cluster import WORKER, RelayCluster

INFO = TransferInfo("t1", 0, 1, ("p0",))
N = 7  # a binary tree of depth 2: rx0 -> rx1, rx2; rx1 -> rx3, rx4; rx2 -> rx5, rx6


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def payload_events(result: dict) -> list[tuple[str, int, str]]:
    return [(pid, size, d) for kind, pid, size, d in (e for e in result["events"] if e[0] == "payload")]


def first_occurrences(ids: list[str]) -> list[str]:
    return list(dict.fromkeys(ids))


def send_all(prod, info, blobs: dict[str, bytes]) -> dict:
    for pid, blob in blobs.items():
        prod.send(info, pid, blob)
    return prod.flush(info, list(blobs))


def check_exits(cluster: RelayCluster, codes: dict) -> None:
    bad = {rx: c for rx, c in codes.items() if c != 0}
    assert not bad, {rx: cluster.log(rx)[-2000:] for rx in bad}
    assert cluster.kill() == []  # nothing left running


# --- topology and configuration (no sockets) --------------------------------------------

def test_tree_topology_timeouts_and_configuration():
    nodes = [{"id": f"rx{i}", "endpoint": f"tcp://127.0.0.1:{10000 + i}"} for i in range(10)]
    t = RelayTransport({"nodes": nodes[:N], "timeout_s": 12})
    assert t.receivers == [f"rx{i}" for i in range(N)] and t.fanout == 2 and t.height == 2
    assert [t.children(i) for i in range(N)] == [[1, 2], [3, 4], [5, 6], [], [], [], []]
    assert [t.parent(i) for i in range(N)] == [None, 0, 0, 1, 1, 2, 2]
    assert t.subtree(1) == ["rx1", "rx3", "rx4"] and sorted(t.subtree(0)) == sorted(t.ids)
    # Deeper links give up first, so the failure nearest to its cause is the one reported.
    assert [t.link_timeout(i) for i in (0, 1, 3)] == [9.0, 6.0, 3.0]
    t3 = RelayTransport({"nodes": nodes, "fanout": 3})
    assert [t3.children(i) for i in range(4)] == [[1, 2, 3], [4, 5, 6], [7, 8, 9], []]
    assert t3.height == 2 and t3.depth(9) == 2
    with pytest.raises(ValueError, match="needs 'nodes'"):
        RelayTransport({})
    with pytest.raises(ValueError, match="unique"):
        RelayTransport({"nodes": [nodes[0], nodes[0]]})
    with pytest.raises(ValueError, match="node 1 must be"):
        RelayTransport({"nodes": [nodes[0], {"id": "rx1", "endpoint": "ipc:///tmp/x"}]})
    with pytest.raises(ValueError, match="are not the nodes"):
        RelayTransport({"nodes": nodes[:2]}, receivers=["rx0", "rx9"])
    with pytest.raises(ValueError, match="max_in_flight_bytes must be > 0"):
        RelayTransport({"nodes": nodes[:2], "max_in_flight_bytes": 0})
    with pytest.raises(ValueError, match="is not one of the nodes"):
        t.receiver("rx9")
    with pytest.raises(ValueError, match="needs config\\['coordinator'\\]"):
        t.coordinator()


def test_registry_finds_the_relay_transport():
    if "relay" not in registry.available("nemo_dcr.transports"):
        pytest.skip("relay is not registered (its entry point: pip install -e .)")
    t = registry.transport("relay", {"nodes": [{"id": "rx0", "endpoint": "tcp://127.0.0.1:1"}]})
    assert isinstance(t, RelayTransport) and t.receivers == ["rx0"]


# --- data plane over 7 relay processes ---------------------------------------------------

def test_every_node_gets_every_payload_in_order(tmp_path):
    rng = __import__("random").Random(0)
    blobs = {f"p0-{i}": os.urandom(rng.choice([0, 1, 100, 5000, 70000])) for i in range(30)}
    blobs["p0-30"] = os.urandom(3 << 20)  # larger than the window: goes alone
    with RelayCluster(N, tmp_path, window_bytes=1 << 20) as cluster:
        prod = cluster.transport().producer("p0")
        try:
            for pid, blob in blobs.items():
                prod.send(INFO, pid, blob)
                if pid == "p0-5":
                    prod.send(INFO, "p0-2", blobs["p0-2"])  # a retry: identical bytes, same id
            assert prod.flush(INFO, list(blobs)) == {}
            assert prod.in_flight_bytes == 0 and not prod.in_flight
        finally:
            prod.close()
        check_exits(cluster, cluster.shutdown())
        want = {pid: (len(b), digest(b)) for pid, b in blobs.items()}
        for rx in cluster.ids:
            result = cluster.result(rx)
            got = payload_events(result)
            assert {pid: (n, d) for pid, n, d in got} == want, rx
            assert first_occurrences([pid for pid, _, _ in got]) == list(blobs), rx  # FIFO on every link
            extra = [pid for pid in [p for p, _, _ in got] if pid != "p0-2"]
            assert len(extra) == len(blobs) - 1, rx  # only the retried payload may arrive twice
            manifests = [m for kind, m in (e for e in result["events"] if e[0] != "payload") if kind == "manifest"]
            assert [m["payload_ids"] for m in manifests] == [list(blobs)]
            assert result["stats"]["held_bytes"] == 0 and result["stats"]["lost"] == 0


def test_slow_leaf_back_pressures_the_producer_through_the_tree(tmp_path):
    bound, window, delay = 4096, 2048, 0.03
    with RelayCluster(N, tmp_path, max_in_flight_bytes=bound, window_bytes=window,
                      node_args={6: ["--delay", str(delay)]}) as cluster:
        prod = cluster.transport().producer("p0")
        peak = 0
        try:
            t0 = time.monotonic()
            for i in range(30):
                prod.send(INFO, f"p0-{i}", b"x" * 1000)
                peak = max(peak, prod.in_flight_bytes)
            send_s = time.monotonic() - t0
            assert prod.flush(INFO, [f"p0-{i}" for i in range(30)]) == {}
            assert prod.in_flight_bytes == 0
        finally:
            prod.close()
        check_exits(cluster, cluster.shutdown())
        assert 0 < peak <= bound
        # The producer may run at most `bound` ahead of the slow leaf two hops away.
        assert send_s > (30 - bound // 1000 - 1) * delay * 0.8, send_s
        stats = {rx: cluster.result(rx)["stats"] for rx in cluster.ids}
        assert stats["rx0"]["peak_held_bytes"] <= bound
        for rx, s in stats.items():
            assert s["peak_link_bytes"] <= window, (rx, s)
            if rx != "rx0":
                assert s["peak_held_bytes"] <= window, (rx, s)  # bounded by the parent's window
        assert len(payload_events(cluster.result("rx6"))) == 30


def test_rejections_are_reported_per_receiver_by_flush(tmp_path):
    with RelayCluster(N, tmp_path, node_args={3: ["--reject", "p0-1"], 6: ["--reject", "p0-1,p0-2"]}) as cluster:
        prod = cluster.transport().producer("p0")
        try:
            blobs = {f"p0-{i}": b"abc%d" % i for i in range(4)}
            assert send_all(prod, INFO, blobs) == {"rx3": {"p0-1": "bad"}, "rx6": {"p0-1": "bad", "p0-2": "bad"}}
            info2 = TransferInfo("t2", 1, 2, ("p0",))  # rejections are per transfer
            assert send_all(prod, info2, {"p0-9": b"fine"}) == {}
        finally:
            prod.close()
        check_exits(cluster, cluster.shutdown())


def test_missing_leaf_is_named_by_producer_and_coordinator_within_the_timeout(tmp_path):
    timeout = 2.0
    with RelayCluster(N, tmp_path, timeout_s=timeout, absent=(5,)) as cluster:
        t = cluster.transport()
        prod, coord = t.producer("p0"), t.coordinator()
        try:
            start = time.monotonic()
            with pytest.raises(TransportError) as err:
                send_all(prod, INFO, {f"p0-{i}": b"abc" for i in range(3)})
            assert time.monotonic() - start < timeout + 1
            msg = str(err.value)
            assert "receivers ['rx5']" in msg and f"relay rx5 at {cluster.endpoint(5)}" in msg, msg
            assert not prod.in_flight  # the failed transfer does not block the next one
            start = time.monotonic()
            with pytest.raises(TransportError, match=f"relay rx5 at {cluster.endpoint(5)} did not accept 'begin'"):
                coord.broadcast("begin", {"transfer_id": "t1"})
            assert time.monotonic() - start < timeout + 1
            with pytest.raises(TransportError, match=r"receivers \['rx5'\] sent no 'ready' for transfer t1"):
                coord.collect("ready", "t1", 1)
        finally:
            prod.close()
            coord.close()
        check_exits(cluster, cluster.terminate())
        for rx in cluster.ids:  # the rest of the tree still got everything
            if rx != "rx5":
                assert [p for p, _, _ in payload_events(cluster.result(rx))] == ["p0-0", "p0-1", "p0-2"], rx


def test_missing_root_is_named_within_the_timeout():
    nodes = [{"id": f"rx{i}", "endpoint": f"tcp://127.0.0.1:{free_port()}"} for i in range(3)]
    t = RelayTransport({"nodes": nodes, "timeout_s": 1})
    prod = t.producer("p0")
    start = time.monotonic()
    try:
        with pytest.raises(TransportError, match=f"root relay rx0 at {nodes[0]['endpoint']} did not accept"):
            prod.send(INFO, "p0-0", b"abc")
        assert time.monotonic() - start < 3
    finally:
        prod.close()


@pytest.mark.parametrize("node,mode,receivers,names", [
    # a relay that never answers: named with its whole subtree
    (2, "dead", "['rx2', 'rx5', 'rx6']", "relay rx2 at {endpoint}"),
    # a hung receiver behind a live relay
    (4, "deaf", "['rx4']", "receiver rx4 at {endpoint} staged nothing"),
])
def test_a_silent_node_is_named_with_what_it_holds_up(tmp_path, node, mode, receivers, names):
    with RelayCluster(N, tmp_path, timeout_s=2, node_args={node: ["--mode", mode]}) as cluster:
        prod = cluster.transport().producer("p0")
        try:
            start = time.monotonic()
            with pytest.raises(TransportError) as err:
                send_all(prod, INFO, {f"p0-{i}": b"abc" for i in range(5)})
            assert time.monotonic() - start < 3
            msg = str(err.value)
            assert f"receivers {receivers}" in msg and names.format(endpoint=cluster.endpoint(node)) in msg, msg
        finally:
            prod.close()
        check_exits(cluster, cluster.terminate())


def test_coordinator_collects_and_names_missing_receivers(tmp_path):
    with RelayCluster(N, tmp_path, timeout_s=2, node_args={3: ["--no-reply"]}) as cluster:
        coord = cluster.transport().coordinator()
        try:
            coord.broadcast("begin", {"transfer_id": "t1"})
            with pytest.raises(TransportError, match=rf"receivers \['rx3'\] sent no 'ready' for transfer t1 within 1 s "
                                                     rf"\(rx3 at {cluster.endpoint(3)}\)"):
                coord.collect("ready", "t1", 1)
            coord.broadcast("verify", {"transfer_id": "v1"})
            replies = coord.collect("verified", "v1", 5)
            assert sorted(replies) == cluster.ids and all(r["seen"] == 2 for r in replies.values())
            coord.broadcast("shutdown", {})
        finally:
            coord.close()
        check_exits(cluster, cluster.wait(10))
        for rx in cluster.ids:
            kinds = [e[0] for e in cluster.result(rx)["events"]]
            assert kinds == ["begin", "verify", "shutdown"], (rx, kinds)


def test_empty_transfer_and_many_small_payloads_from_two_producers(tmp_path):
    with RelayCluster(N, tmp_path, window_payloads=32) as cluster:
        t = cluster.transport()
        prods = {p: t.producer(p) for p in ("p0", "p1")}
        try:
            start = time.monotonic()
            assert prods["p0"].flush(INFO, []) == {}  # nothing to wait for
            assert time.monotonic() - start < 1
            info2 = TransferInfo("t2", 1, 2, ("p0", "p1"))
            blobs = {p: {f"{p}-{i:04d}": os.urandom(i % 65) for i in range(250)} for p in prods}
            results, errors = {}, []

            def run(p):
                try:
                    results[p] = send_all(prods[p], info2, blobs[p])
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            start = time.monotonic()
            threads = [threading.Thread(target=run, args=(p,)) for p in prods]
            for th in threads:
                th.start()
            for th in threads:
                th.join(60)
            elapsed = time.monotonic() - start
            assert not errors and results == {"p0": {}, "p1": {}}
        finally:
            for prod in prods.values():
                prod.close()
        check_exits(cluster, cluster.shutdown())
        assert elapsed < 30, elapsed
        for rx in cluster.ids:
            result = cluster.result(rx)
            got = payload_events(result)
            for p in prods:  # each producer's payloads arrive in its order, interleaved with the other's
                assert [e for e in got if e[0].startswith(p)] == [(i, len(b), digest(b)) for i, b in blobs[p].items()]
            assert len(got) == 500
            manifests = sorted(e[1]["payload_ids"] for e in result["events"] if e[0] == "manifest")
            assert manifests == sorted([[], list(blobs["p0"]), list(blobs["p1"])]), rx


def test_in_process_root_with_relay_children_shuts_down_cleanly(tmp_path):
    """A relay end in this process (the root) forwarding to two relay processes; after
    shutdown no thread, socket or process is left and every port can be bound again."""
    fds_before = set(os.listdir("/proc/self/fd"))
    threads_before = set(threading.enumerate())
    with RelayCluster(3, tmp_path, absent=(0,)) as cluster:
        t = cluster.transport()
        root, seen = t.receiver("rx0"), []
        stop = threading.Event()

        def drain():
            while not stop.is_set():
                ev = root.poll(0.05)
                if ev is None:
                    continue
                if ev.kind == "payload":
                    seen.append((ev.meta["payload_id"], bytes(ev.data)))
                    root.staged(ev.meta["transfer_id"], ev.meta["producer_id"], ev.meta["payload_id"], None)
                elif ev.kind == "shutdown":
                    stop.set()
                ev.release()

        th = threading.Thread(target=drain)
        th.start()
        prod = t.producer("p0")
        try:
            blobs = {f"p0-{i}": os.urandom(2000) for i in range(10)}
            assert send_all(prod, INFO, blobs) == {}
            assert dict(seen) == blobs
            check_exits(cluster, cluster.shutdown())  # the coordinator reaches the in-process root too
            th.join(5)
            assert not th.is_alive()
        finally:
            stop.set()
            th.join(5)
            prod.close()
            root.close()
        assert len(payload_events(cluster.result("rx1"))) == len(payload_events(cluster.result("rx2"))) == 10
    assert set(threading.enumerate()) == threads_before
    assert set(os.listdir("/proc/self/fd")) <= fds_before
    for node in cluster.config["nodes"] + [{"endpoint": cluster.config["coordinator"]}]:
        with socket.socket() as s:  # nobody listens there any more (TIME_WAIT is fine)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", int(node["endpoint"].rsplit(":", 1)[1])))
            s.listen()


# --- MPI (only where mpi4py and an MPI launcher are installed) ---------------------------

def _mpirun() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else shutil.which("mpirun")


def test_nodes_from_mpi_without_mpi4py_says_what_is_missing(monkeypatch):
    # mpi4py made unimportable here (the test extras install it): what a user without it sees
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(RuntimeError, match="needs mpi4py and an MPI library"):
        nodes_from_mpi(None, 20000)


def test_nodes_from_mpi_builds_the_tree_under_mpirun(tmp_path):
    mpirun = _mpirun()
    if mpirun is None:
        pytest.skip("needs mpi4py and mpirun (pip install mpi4py mpich)")
    for _ in range(20):  # three consecutive free ports
        base = free_port()
        try:
            for i in range(3):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + i))
            break
        except OSError:
            continue
    config = {"coordinator": f"tcp://127.0.0.1:{free_port()}", "timeout_s": 5}
    log = tmp_path / "mpirun.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([mpirun, "-n", "3", sys.executable, str(WORKER), "--mpi", str(base),
                                 "--config", json.dumps(config), "--out", str(tmp_path / "node")],
                                env=worker_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while log.read_text().count("READY") < 3:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        nodes = [{"id": f"rx{r}", "endpoint": f"tcp://127.0.0.1:{base + r}"} for r in range(3)]
        assert f"READY {json.dumps(nodes)}" in log.read_text()
        t = RelayTransport({**config, "nodes": nodes})
        prod, coord = t.producer("p0"), t.coordinator()
        try:
            blobs = {f"p0-{i}": os.urandom(100) for i in range(5)}
            assert send_all(prod, INFO, blobs) == {}
            coord.broadcast("shutdown", {})
        finally:
            prod.close()
            coord.close()
        assert proc.wait(20) == 0, log.read_text()
        for r in range(3):
            result = json.loads((tmp_path / f"node.rx{r}").read_text())
            assert [p for p, _, _ in payload_events(result)] == list(blobs)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


# --- a refit through the tree into real HF receivers (nemo-dcr receive processes) -------

@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("ckpt")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    return path


def test_refit_over_the_relay_tree_is_bit_exact(hf_checkpoint, tmp_path, single_rank_group):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from nemo_dcr.capture import torch_owned_ranges
    from nemo_dcr.checkpoint import read_specs
    from nemo_dcr.errors import TransferFailed
    from nemo_dcr.layout import ParallelLayout
    from nemo_dcr.trainer import TrainerRefit
    from nemo_dcr.verify import bit_mismatches

    with RelayCluster(4, tmp_path / "nodes", checkpoint=hf_checkpoint, timeout_s=30) as cluster:
        cluster_ready = time.monotonic()
        transport = RelayTransport(cluster.config, receivers=cluster.ids)
        model = AutoModelForCausalLM.from_pretrained(hf_checkpoint, dtype=torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        refit = TrainerRefit(registry.converter("identity", model.config), read_specs(hf_checkpoint),
                             torch_owned_ranges(model), ParallelLayout(), transport,
                             state_dir=str(tmp_path / "state"), max_payload_elements=500, timeout_s=30)
        expected = lambda: {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # noqa: E731

        def step():
            ids = torch.randint(0, 300, (2, 16))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

        def check(version, dump):
            replies = refit.coordinator.verify(str(dump))
            assert sorted(replies) == cluster.ids
            for rx, r in replies.items():
                assert r["version"] == version, rx
                assert bit_mismatches(expected(), load_file(r["dump"])) == [], rx

        try:
            torch.manual_seed(1)
            result = refit.refit()  # nothing changed yet: an empty transfer still commits
            assert result.decision.committed and result.changed_elements == 0
            for version in (2, 3):
                step()
                result = refit.refit()
                assert result.decision.committed and result.decision.version == version
                assert 0 < result.changed_elements < result.scanned_elements
                assert result.metrics()["payloads"] > 1
            dump = tmp_path / "dump"
            dump.mkdir()
            check(3, dump)
            # Every receiver rejects signed payloads (it has no key): reported through the
            # tree, the transfer aborts everywhere and nothing moves.
            step()
            refit.producer.key = b"not-the-receivers-key"
            with pytest.raises(TransferFailed, match="HMAC"):
                refit.refit()
            refit.producer.key = None
            assert refit.baseline.version == 3
            step()
            result = refit.refit()  # the delta is taken against the committed version 3
            assert result.decision.committed and result.decision.version == 4
            shutil.rmtree(dump)
            dump.mkdir()
            check(4, dump)
        finally:
            refit.close(shutdown_receivers=True)
        check_exits(cluster, cluster.wait(30))
        print(f"refit test: {time.monotonic() - cluster_ready:.1f} s after the receivers were up")
