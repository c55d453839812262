"""The producer's encode queue on its own: payloads come back in the order submitted,
whichever thread encoded them; one no thread has started is encoded by the thread that
wants it; at most `keep` stay in flight; arenas are handed back and reused; after an
error nothing is left in flight."""

import threading

import pytest

from nemo_dcr.encode_queue import EncodeQueue
from nemo_dcr.payload_builder import EncodedPayload


class NotingEncoder:
    """Encodes a payload as its id, noting the thread; `hold` payloads wait for `gate`,
    and a `release` payload opens it (so the test decides who runs when)."""

    def __init__(self, hold=(), release=(), fail=()):
        self.gate = threading.Event()
        self.hold, self.release, self.fail = set(hold), set(release), set(fail)
        self.threads: dict[str, int] = {}

    def encode(self, batch, payload_id, arena):
        self.threads[payload_id] = threading.get_ident()
        if payload_id in self.release:
            self.gate.set()
        if payload_id in self.hold:
            assert self.gate.wait(10)
        if payload_id in self.fail:
            raise ValueError(f"{payload_id} broken on purpose")
        return EncodedPayload(payload_id.encode(), {}, 0.0, 0.0)


def test_in_order_and_a_job_not_started_is_encoded_here():
    queue = EncodeQueue(1, "test-encode-order")
    queue.start()
    enc = NotingEncoder(hold={"p0"}, release={"p1"})
    queue.submit("p0", None, enc)  # the one thread: held until p1 is encoded
    queue.submit("p1", None, enc)  # not started: the thread is busy with p0
    got = list(queue.collect_all())
    assert [c.payload_id for c in got] == ["p0", "p1"] and [c.encoded.data for c in got] == [b"p0", b"p1"]
    assert enc.threads["p1"] == threading.get_ident() != enc.threads["p0"]
    assert len(queue) == 0 and len(queue.spare_arenas) == 2


def test_keep_leaves_at_most_that_many_in_flight_and_arenas_are_reused():
    queue = EncodeQueue(2, "test-encode-keep")
    queue.start()
    enc = NotingEncoder()
    for i in range(5):
        queue.submit(f"p{i}", None, enc, here=True)  # encoded at once: all done
    assert [c.payload_id for c in queue.collect(keep=5)] == [f"p{i}" for i in range(5)]  # done ones go anyway
    arenas = list(queue.spare_arenas)
    enc = NotingEncoder(hold={"p0", "p1", "p2"})
    for i in range(3):
        queue.submit(f"p{i}", None, enc)
    assert len(queue.spare_arenas) == 2  # three spare arenas taken again, none made anew
    enc.gate.set()
    assert [c.payload_id for c in queue.collect(keep=2)][:1] == ["p0"]
    assert len(queue) <= 2
    list(queue.collect(keep=0))
    assert sorted(map(id, queue.spare_arenas)) == sorted(map(id, arenas))


def test_an_error_is_raised_in_order_and_cancel_leaves_nothing_in_flight():
    queue = EncodeQueue(2, "test-encode-error")
    queue.start()
    enc = NotingEncoder(fail={"p1"})
    for i in range(3):
        queue.submit(f"p{i}", None, enc)
    sent = []
    with pytest.raises(ValueError, match="p1 broken on purpose"):
        for c in queue.collect(keep=0):
            sent.append(c.payload_id)
    assert sent == ["p0"]
    queue.cancel()
    assert len(queue) == 0 and len(queue.spare_arenas) == 3
