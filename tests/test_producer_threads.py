"""Producer(encode_threads=N): payloads are built and encoded on N other threads while the
calling thread diffs on, and the refit sends exactly what the single-threaded producer
sends - the same payload ids, in the same order, byte for byte - from the calling thread."""

import gc
import threading
import time

import numpy as np
import pytest
import torch

from nemo_dcr import sender
from nemo_dcr.baseline import Baseline
from nemo_dcr.layout import LocalParam, OwnedRange
from nemo_dcr.placement import AffineMap, Piece
from nemo_dcr.sender import AUTO, Producer
from nemo_dcr.records import TransferInfo
from nemo_dcr.wire import codec
from tests.support.transports import KeepingEnd

ROWS, COLS = 64, 512


class ThreadNotingEnd(KeepingEnd):
    """Keeps the payloads, their ids and the thread each was sent from."""

    def __init__(self):
        super().__init__()
        self.ids, self.threads = [], set()

    def send(self, transfer, payload_id, data):
        super().send(transfer, payload_id, data)
        self.ids.append(payload_id)
        self.threads.add(threading.get_ident())


def _weights(seed: int = 0):
    """Three row-parallel BF16 weights (TP rank 0 of 2: strided pieces), as Megatron lays
    out a row-parallel linear; (tensors, owned ranges, maps, specs)."""
    torch.manual_seed(seed)
    params, owned, maps, specs = [], [], {}, {}
    for i in range(3):
        t = (torch.randn(ROWS, COLS) * 0.02).to(torch.bfloat16)
        lp = LocalParam(f"w{i}", (ROWS, COLS), torch.bfloat16)
        owned.append(OwnedRange(lp, 0, t.numel(), t.view(-1)))
        maps[f"w{i}"] = AffineMap(f"w{i}", t.numel(), (Piece(f"c{i}", 0, ROWS, COLS, 0, 2 * COLS),))
        specs[f"c{i}"] = ("BF16", (ROWS, 2 * COLS))
        params.append(t)
    return params, owned, maps, specs


def _step(params, rate: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for t in params:
        bits = t.view(-1).view(torch.int16)
        idx = torch.from_numpy(np.flatnonzero(rng.random(bits.numel()) < rate))
        bits[idx] += torch.from_numpy(rng.choice(np.array([1, -1], np.int16), idx.numel()))


def _refits(encode_threads: int, op, transfers) -> list[tuple]:
    """Refits of the same weights and steps, each transfer (attempt, skip, readback) on
    its own baseline copy; per transfer (ids, payloads, readback digests, threads)."""
    params, owned, maps, specs = _weights()
    _step(params, 0.05, seed=1)
    out = []
    for attempt, skip, readback in transfers:
        end = ThreadNotingEnd()
        baseline = Baseline()
        torch.manual_seed(0)  # the committed state: the weights before the step
        committed, _, _, _ = _weights()
        for r, c in zip(owned, committed):
            baseline.register(r.key, c.view(-1).view(torch.int16))
        prod = Producer("p0", owned, maps, specs, baseline, end, op=op, max_payload_elements=500,
                        chunk_elements=4096, encode_threads=encode_threads)
        rep = prod.refit(TransferInfo("t", 0, 1, ("p0",), attempt=attempt, readback=readback), skip=skip)
        out.append((end.ids, end.payloads, rep.readback, rep.payload_ids, rep.all_payload_ids, end.threads))
    return out


@pytest.mark.parametrize("op", ["xor", AUTO])
def test_threads_send_the_same_payloads_in_order_from_the_calling_thread(op):
    transfers = [(0, frozenset(), False), (1, frozenset({"p0-000002", "p0-000005"}), True)]
    single = _refits(0, op, transfers)
    for threads in (1, 3):
        many = _refits(threads, op, transfers)
        for (ids, data, readback, listed, every, sent_from), (ids1, data1, readback1, listed1, every1, _) in zip(
                many, single):
            assert len(every) > 6  # many payloads: several are in flight at once
            assert ids == ids1 == listed == listed1 and every == every1
            assert data == data1  # byte for byte
            assert readback == readback1
            assert sent_from == {threading.get_ident()}
    retry = single[1]
    assert "p0-000002" not in retry[0] and "p0-000002" in retry[2]  # skipped, but its digests are there


def test_an_encoding_error_fails_the_refit_after_the_payloads_before_it_and_leaves_nothing_running(monkeypatch):
    params, owned, maps, specs = _weights()
    baseline = Baseline()
    end = ThreadNotingEnd()
    prod = Producer("p0", owned, maps, specs, baseline, end, max_payload_elements=500, chunk_elements=4096,
                    encode_threads=2)
    _step(params, 0.05, seed=1)
    real = codec.encode
    started, running = [], []

    def failing(payload, **kw):
        started.append(payload.header.payload_id)
        running.append(1)
        try:
            time.sleep(0.01)  # long enough for the threads to have more payloads in hand
            if payload.header.payload_id == "p0-000003":
                raise ValueError("record 'c1': broken on purpose")
            return real(payload, **kw)
        finally:
            running.pop()

    monkeypatch.setattr(codec, "encode", failing)
    with pytest.raises(ValueError, match="broken on purpose"):
        prod.refit(TransferInfo("t", 0, 1, ("p0",)))
    seen = list(started)
    time.sleep(0.2)
    assert not running and started == seen  # nothing of the failed refit runs on, or starts, after it
    assert end.ids == [f"p0-{i:06d}" for i in range(3)]  # those before the failure, in order
    baseline.abort()
    monkeypatch.setattr(codec, "encode", real)
    rep = prod.refit(TransferInfo("t2", 0, 1, ("p0",)))  # the producer is usable again
    assert rep.payload_ids == end.ids[3:] and len(rep.payload_ids) > 6
    assert len(prod.encode_queue.spare_arenas) <= 2 + 1  # arenas come back to the pool, not one per payload


def test_encoding_threads_are_kept_between_refits_and_end_with_the_producer():
    params, owned, maps, specs = _weights()
    baseline = Baseline()
    # An id of its own: threads of other tests' producers may still be on their way out.
    prod = Producer("kept", owned, maps, specs, baseline, KeepingEnd(), max_payload_elements=500,
                    chunk_elements=4096, encode_threads=2)

    def encoders():
        return {t.ident for t in threading.enumerate() if t.name.startswith("dcr-encode-kept")}

    _step(params, 0.05, seed=1)
    prod.refit(TransferInfo("t", 0, 1, ("kept",)))
    first = encoders()
    baseline.abort()
    prod.refit(TransferInfo("t2", 0, 1, ("kept",)))
    assert first and encoders() == first  # the same threads (and their malloc arenas) again
    del prod
    gc.collect()
    deadline = time.monotonic() + 5
    while encoders() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not encoders()


@pytest.mark.parametrize("bad", [-1, 1.5, "2", None])
def test_bad_encode_threads_is_named(bad):
    params, owned, maps, specs = _weights()
    with pytest.raises(ValueError, match="encode_threads must be an int >= 0"):
        Producer("p0", owned, maps, specs, Baseline(), KeepingEnd(), encode_threads=bad)


def test_report_times_with_threads():
    params, owned, maps, specs = _weights()
    prod = Producer("p0", owned, maps, specs, Baseline(), KeepingEnd(), max_payload_elements=500,
                    chunk_elements=4096, encode_threads=2)
    _step(params, 0.05, seed=1)
    rep = prod.refit(TransferInfo("t", 0, 1, ("p0",)))
    assert rep.times["encode"] > 0 and rep.times["encode_wait"] >= 0
    assert sender.ProducerReport("x").times.keys() == rep.times.keys()


@pytest.mark.parametrize("first", [None, 64, 500])
def test_the_first_payload_is_cut_early_the_others_at_the_limit(first):
    """The first payload leaves after a sixteenth of a full one's diffing (by default), so
    bytes reach the link early; the later ones are cut at max_payload_elements. A chunk
    (4096 elements) is the finest cut, so a payload holds at most the limit + one chunk's
    changes."""
    params, owned, maps, specs = _weights()
    end = KeepingEnd()
    prod = Producer("p0", owned, maps, specs, Baseline(), end, max_payload_elements=2000, chunk_elements=4096,
                    first_payload_elements=first)
    _step(params, 0.05, seed=1)
    prod.refit(TransferInfo("t", 0, 1, ("p0",)))
    sizes = [sum(len(r) for r in codec.decode(d).records) for d in end.payloads]
    past = 4096 * 0.08  # a chunk's changes at 5%, with room: no payload runs past its cut by more
    cut = first or 2000 // 16
    assert cut <= sizes[0] < cut + past
    assert len(sizes) > 3 and all(2000 <= n < 2000 + past for n in sizes[1:-1]) and sizes[-1] < 2000 + past


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8"])
def test_first_payload_elements_is_checked(bad):
    params, owned, maps, specs = _weights()
    with pytest.raises(ValueError, match="first_payload_elements must be a positive int"):
        Producer("p0", owned, maps, specs, Baseline(), KeepingEnd(), first_payload_elements=bad)
