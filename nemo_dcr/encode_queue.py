"""Payloads encoded on other threads while the producer diffs on (`Producer(encode_threads=N)`),
handed back in payload order, so they leave from the producer's thread as they would
without threads: the same ids, the same bytes, the same order.

The compiled kernels run without the GIL, so N threads encode while the producer's own
thread diffs. At most N payloads wait (bounded memory); a payload no thread has started
when it is wanted is encoded by the thread that wants it rather than waited for. Each
payload is encoded in an `Arena` of its own, given back to the queue when it is
collected and reused by a later payload (fresh pages cost more than the copies)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import NamedTuple

from nemo_dcr.arena import Arena
from nemo_dcr.payload_builder import EncodedPayload, PayloadBatch, PayloadEncoder


class EncodeJob(NamedTuple):
    """One payload to encode, in an arena of its own."""

    payload_id: str
    batch: PayloadBatch
    arena: Arena
    encoder: PayloadEncoder

    def run(self) -> EncodedPayload:
        return self.encoder.encode(self.batch, self.payload_id, self.arena)


class InFlight(NamedTuple):
    """A job handed to the threads (or run here), and its result to come."""

    job: EncodeJob
    result: Future


class Collected(NamedTuple):
    """A payload taken from the queue, in payload order."""

    payload_id: str
    encoded: EncodedPayload
    wait_s: float  # seconds the collecting thread spent on it: waiting, or encoding it itself


class EncodeQueue:
    """The encoding threads (`threads`, started by `start`, kept for the owner's life: fresh
    threads every refit would also start on fresh malloc arenas, i.e. page faults; idle, they
    wait on a queue and exit with it) and the payloads in flight on them, in order."""

    def __init__(self, threads: int, name: str):
        self.threads, self.name = threads, name
        self.spare_arenas: list[Arena] = []  # arenas of collected payloads, for the next ones
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: deque[InFlight] = deque()

    def start(self) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, self.name)

    def __len__(self) -> int:
        return len(self._in_flight)

    def submit(self, payload_id: str, batch: PayloadBatch, encoder: PayloadEncoder, *, here: bool = False) -> None:
        """Queue a payload behind those in flight; `here`: encode it on this thread now (the
        last payload of a refit: nothing is left to diff, and the hand-over would only cost)."""
        arena = self.spare_arenas.pop() if self.spare_arenas else Arena()
        job = EncodeJob(payload_id, batch, arena, encoder)
        self._in_flight.append(InFlight(job, _run_now(job.run) if here else self._pool.submit(job.run)))

    def collect(self, keep: int) -> Iterator[Collected]:
        """The payloads encoded so far, in order, until at most `keep` are left in flight (an
        encoding error is raised here). One that no thread has started yet is encoded here
        rather than waited for."""
        while self._in_flight and (len(self._in_flight) > keep or self._in_flight[0].result.done()):
            job, result = self._in_flight.popleft()
            t = time.perf_counter()
            try:
                encoded = job.run() if result.cancel() else result.result()
            finally:
                self.spare_arenas.append(job.arena)
            yield Collected(job.payload_id, encoded, time.perf_counter() - t)

    def collect_all(self) -> Iterator[Collected]:
        """At the end of a refit: encode here, newest first, what no thread has started, while
        the threads finish the older ones; then every payload, in order."""
        for k in reversed(range(len(self._in_flight))):
            job, result = self._in_flight[k]
            if result.cancel():
                self._in_flight[k] = InFlight(job, _run_now(job.run))
        yield from self.collect(keep=0)

    def cancel(self) -> None:
        """After an error: nothing left running or queued, the arenas free again."""
        if not self._in_flight:
            return
        for item in self._in_flight:
            item.result.cancel()
        futures_wait([item.result for item in self._in_flight])
        self.spare_arenas.extend(item.job.arena for item in self._in_flight)
        self._in_flight.clear()


def _run_now(fn, *args) -> Future:
    """fn(*args) run on this thread, as a finished Future (its result or its exception)."""
    done: Future = Future()
    try:
        done.set_result(fn(*args))
    except BaseException as e:  # raised again where the result is taken, in payload order
        done.set_exception(e)
    return done
