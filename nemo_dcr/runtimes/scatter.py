"""The pause's compiled scatters, spread over threads.

Why: while the runtime is paused its host's cores have nothing else to do, and one
core's scatter does not take all of the memory system: on a 2-core host a second thread
took about a fifth off the kernel's time and about a tenth off a receiver's whole pause
(BENCHMARKS.md, "Receiver pause"). The kernel releases the GIL (numba `nogil`), so
plain threads run it side by side.

A job is one record on one destination. Jobs are cut into pieces of at most `piece`
changes, so that one large tensor does not leave the other threads idle; a job's
positions are strictly increasing, so its pieces write disjoint elements. The kernel
checks the positions inside each piece as it writes them; the seams between pieces are
checked here, before anything is written. All or nothing per job: a job whose
positions are bad anywhere has every change it applied taken back before `run`
returns, and is reported as not applied.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from nemo_dcr import digest, kernels
from nemo_dcr.runtimes.base import negated

XOR, ADD = 0, 1  # kernels.scatter.scatter_apply's op codes (overwrites stay on the caller's thread)


@dataclass(frozen=True)
class Job:
    flat: np.ndarray  # the destination's flat unsigned bit view, written in place
    positions: np.ndarray  # into `flat`: int64 or uint32, meant to be strictly increasing
    values: np.ndarray  # `flat`'s dtype, one a position
    op: int  # XOR or ADD
    # (mask, T_0, T_1) of `digest.kernel_keys`: the scatter also sums how the whole-state
    # digest moves, into `sums` (set by `ScatterPool.run` for a job applied whole)
    keys: tuple[int, int, int] | None = None
    sums: np.ndarray = field(default_factory=lambda: np.zeros(2, np.uint64))

    def taken_back(self, lo: int, hi: int) -> None:
        """Undo this job's changes lo..hi (applied): xor again, or add the negation."""
        values = self.values[lo:hi]
        kernels.scatter.scatter_apply(self.flat, self.positions[lo:hi], negated(values) if self.op == ADD else values,
                                      self.op)


def _only_idle_cores() -> None:
    """Run the calling helper thread only on cores nothing else wants (SCHED_IDLE; else
    the lowest nice): on a host that also relays to a subtree, decodes for another
    replica or serves, the pause's extra threads must not slow that work down, while the
    caller's own thread applies at its normal priority."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass  # no per-thread priorities here: the helpers run at the caller's


APPLY_THREADS_CAP = 8  # the scatter is memory-bound: past a few threads the memory system is the bound


def share_of_cores(cores: int, sharers: int = 1, cap: int | None = APPLY_THREADS_CAP) -> int:
    """`cores` divided among `sharers` processes that run at the same time (a
    tensor-parallel engine's workers on one host), at least 1 and at most `cap` (None:
    no cap; decoding is compute-bound)."""
    share = max(1, cores // max(1, sharers))
    return share if cap is None else min(share, cap)


def default_threads(sharers: int = 1, cap: int | None = APPLY_THREADS_CAP) -> int:
    """`share_of_cores` of the cores this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return share_of_cores(cores, sharers, cap)


def resolve_threads(threads: int | None, what: str = "apply threads", cap: int | None = APPLY_THREADS_CAP) -> int:
    """`threads`, checked, or `default_threads(cap=cap)` for None; `what` names it in the error."""
    if threads is None:
        return default_threads(cap=cap)
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"{what} must be a positive integer or None (the cores), got {threads!r}")
    return threads


class ScatterPool:
    """Applies scatter jobs on `threads` threads (the caller's one of them)."""

    def __init__(self, threads: int | None = None, piece: int = 1 << 17):
        threads = resolve_threads(threads)
        if not isinstance(piece, int) or isinstance(piece, bool) or piece < 1:
            raise ValueError(f"piece must be a positive integer, got {piece!r}")
        self.threads, self.piece = threads, piece
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Let the helper threads exit (a later `run` starts new ones)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def run(self, jobs: list[Job]) -> list[bool]:
        """Apply every job; per job, True when applied whole, False when its positions
        are bad (nothing of it is left applied). An exception raised while applying
        (none is expected: the kernel checks what it indexes) is raised here after every
        piece that completed has been taken back."""
        pieces = []  # (job index, lo, hi)
        good = [True] * len(jobs)
        for j, job in enumerate(jobs):
            n = job.positions.size
            cuts = np.arange(self.piece, n, self.piece)
            if cuts.size and not bool(np.all(job.positions[cuts - 1] < job.positions[cuts])):
                good[j] = False  # a seam out of order: no piece of it is dispatched
                continue
            pieces.extend((j, lo, min(lo + self.piece, n)) for lo in range(0, n, self.piece))
        results, sums = self._apply(jobs, pieces)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            good = [False] * len(jobs)  # raised: nothing of any job is left applied
        for (j, _, _), r in zip(pieces, results):
            if r:  # 1 + a bad index (or the exception)
                good[j] = False
        for (j, lo, hi), r in zip(pieces, results):
            if not good[j] and r is not None and not isinstance(r, BaseException):
                jobs[j].taken_back(lo, hi if r == 0 else lo + r - 1)
        if failure is not None:
            raise failure
        for (j, _, _), piece_sums in zip(pieces, sums):
            if good[j] and jobs[j].keys is not None:
                np.add(jobs[j].sums, piece_sums, out=jobs[j].sums)  # wraps mod 2**64, as the lanes do
        return good

    def _apply(self, jobs: list[Job], pieces: list[tuple[int, int, int]]) -> tuple[list, np.ndarray]:
        """Per piece: the kernel's result (0, or 1 + the first bad index within it), the
        exception it raised, or None if it was not run (another piece raised first); and
        per piece, how its writes moved the digest (for jobs with `keys`)."""
        results: list = [None] * len(pieces)
        sums = np.zeros((len(pieces), 2), np.uint64)  # per piece: its own, so no two threads add to one
        counter = itertools.count()  # next() on it is atomic under the GIL: each piece runs once
        stop = threading.Event()

        def work() -> None:
            while not stop.is_set():
                k = next(counter)
                if k >= len(pieces):
                    return
                j, lo, hi = pieces[k]
                job = jobs[j]
                try:
                    if job.keys is None:
                        results[k] = kernels.scatter.scatter_apply(job.flat, job.positions[lo:hi], job.values[lo:hi],
                                                                   job.op)
                    else:
                        results[k] = digest.scatter_sums(job.flat, job.positions[lo:hi], job.values[lo:hi], job.op,
                                                         *job.keys, sums[k])
                except BaseException as e:  # noqa: BLE001 - handed to the caller with the rest undone
                    results[k] = e
                    stop.set()

        # Threads for at least a piece's worth of changes each: a handful of small records is
        # applied on the calling thread alone (handing them over would cost more than it saves).
        changes = sum(hi - lo for _, lo, hi in pieces)
        helpers = min(self.threads, -(-changes // self.piece)) - 1
        if helpers <= 0:
            work()
            return results, sums
        if self._pool is None:
            # Kept for the runtime's life: idle, the threads wait on a queue.
            self._pool = ThreadPoolExecutor(self.threads - 1, "dcr-apply", initializer=_only_idle_cores)
        futures = [self._pool.submit(work) for _ in range(helpers)]
        work()
        for f in futures:
            f.result()
        return results, sums
