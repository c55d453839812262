"""The transport contract, checked the same way for every transport on real parts:
delivery to every receiver, manifests, back-pressure, rejections, timeouts that
name the silent peer, the coordinator's control plane, and cleanup."""

from __future__ import annotations

import os
import time

import pytest

from tests.support.transports import TRANSPORTS, leftovers, open_transport, run_receivers
from nemo_dcr.errors import TransportError
from nemo_dcr.records import TransferInfo

INFO = TransferInfo("t1", 0, 1, ("p0",))


@pytest.fixture(params=TRANSPORTS)
def make(request, tmp_path):
    """make(receivers=..., **config) -> a transport of the parametrized kind."""
    made = []

    def factory(receivers=("rx0", "rx1"), **config):
        t = open_transport(request.param, tmp_path, list(receivers), **config)
        made.append(t)
        return t

    yield factory
    for t in made:
        t.cleanup()


def test_every_receiver_gets_every_payload_and_segments_are_removed(make):
    t = make()
    seen, finish = run_receivers(t, t.receivers)
    prod = t.producer("p0")
    try:
        blobs = {f"p0-{i}": os.urandom(1000 + i) for i in range(20)}
        for pid, blob in blobs.items():
            prod.send(INFO, pid, blob)
        assert prod.flush(INFO, list(blobs)) == {}
        time.sleep(0.2)
        for rx in t.receivers:
            got = {pid: data for pid, data in seen[rx] if isinstance(data, bytes)}
            assert got == blobs
            assert seen[rx][-1][0] == "manifest" and seen[rx][-1][1]["payload_ids"] == list(blobs)
        assert leftovers(t) == []  # payload storage is released once every receiver staged it
    finally:
        prod.close()
        finish()
        t.cleanup()
    assert leftovers(t) == []


def test_slow_receiver_back_pressures_the_producer(make):
    bound = 4096
    t = make(receivers=("rx0",), max_in_flight_bytes=bound)
    seen, finish = run_receivers(t, t.receivers, delay=0.02)
    prod = t.producer("p0")
    peak = 0
    try:
        for i in range(30):
            prod.send(INFO, f"p0-{i}", b"x" * 1000)
            peak = max(peak, prod.in_flight_bytes)
        prod.flush(INFO, [f"p0-{i}" for i in range(30)])
        assert 0 < peak <= bound
        assert prod.in_flight_bytes == 0
    finally:
        prod.close()
        finish()
        t.cleanup()


def test_rejections_are_reported_by_flush(make):
    t = make(receivers=("rx0",))
    seen, finish = run_receivers(t, t.receivers, reject={"p0-1"})
    prod = t.producer("p0")
    try:
        for i in range(3):
            prod.send(INFO, f"p0-{i}", b"abc")
        assert prod.flush(INFO, ["p0-0", "p0-1", "p0-2"]) == {"rx0": {"p0-1": "bad"}}
    finally:
        prod.close()
        finish()
        t.cleanup()


def test_missing_receiver_fails_within_the_timeout_and_names_it(make):
    t = make(receivers=("rx-absent",), timeout_s=1)
    prod = t.producer("p0")
    start = time.monotonic()
    try:
        with pytest.raises(TransportError, match="rx-absent"):
            prod.send(INFO, "p0-0", b"abc")
        assert time.monotonic() - start < 5
    finally:
        prod.close()
        t.cleanup()
    assert leftovers(t) == []


def test_silent_receiver_times_out_in_flush(make):
    t = make(receivers=("rx0",), timeout_s=1)
    end = t.receiver("rx0")  # bound, but never polls or acks
    prod = t.producer("p0")
    try:
        prod.send(INFO, "p0-0", b"abc")
        with pytest.raises(TransportError, match="rx0"):
            prod.flush(INFO, ["p0-0"])
    finally:
        prod.close()
        end.close()
        t.cleanup()


def test_coordinator_collects_and_names_missing_receivers(make):
    t = make(receivers=("rx0", "rx1"), timeout_s=1)
    ends = {rx: t.receiver(rx) for rx in t.receivers}
    coord = t.coordinator()
    try:
        coord.broadcast("begin", {"transfer_id": "t1"})
        for rx, end in ends.items():
            ev = end.poll(2)
            assert ev.kind == "begin" and ev.meta["transfer_id"] == "t1"
        ends["rx0"].reply("ready", {"transfer_id": "t1", "error": None})
        with pytest.raises(TransportError, match="rx1"):
            coord.collect("ready", "t1", 1)
        ends["rx0"].reply("ready", {"transfer_id": "t1"})
        ends["rx1"].reply("ready", {"transfer_id": "t1"})
        assert set(coord.collect("ready", "t1", 2)) == {"rx0", "rx1"}
    finally:
        coord.close()
        for end in ends.values():
            end.close()
        t.cleanup()


def test_empty_transfer_flushes_at_once(make):
    t = make(receivers=("rx0",))
    seen, finish = run_receivers(t, t.receivers)
    prod = t.producer("p0")
    try:
        assert prod.flush(INFO, []) == {}
        deadline = time.monotonic() + 5
        while not seen["rx0"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen["rx0"] == [("manifest", {"kind": "manifest", "transfer_id": "t1", "producer_id": "p0",
                                            "payload_ids": []})]
    finally:
        prod.close()
        finish()


def test_many_small_payloads(make):
    t = make(receivers=("rx0", "rx1"))
    seen, finish = run_receivers(t, t.receivers)
    prod = t.producer("p0")
    try:
        ids = [f"p0-{i:04d}" for i in range(300)]
        for pid in ids:
            prod.send(INFO, pid, pid.encode())
        assert prod.flush(INFO, ids) == {}
        for rx in t.receivers:
            assert sorted(pid for pid, data in seen[rx] if isinstance(data, bytes)) == ids
    finally:
        prod.close()
        finish()


def test_large_payload_arrives_intact(make):
    t = make(receivers=("rx0",), max_in_flight_bytes=128 << 20, timeout_s=60)
    seen, finish = run_receivers(t, t.receivers)
    prod = t.producer("p0")
    blob = os.urandom(1 << 20) * 70  # 70 MiB: past one 64 MiB part
    try:
        prod.send(INFO, "p0-big", blob)
        assert prod.flush(INFO, ["p0-big"]) == {}
        (got,) = [data for pid, data in seen["rx0"] if pid == "p0-big"]
        assert got == blob
    finally:
        prod.close()
        finish()
    assert leftovers(t) == []
