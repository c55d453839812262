"""The pause's scatters on several threads (nemo_dcr.runtimes.scatter): the same bits as
one thread, and all or nothing per job when positions are bad anywhere."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_dcr import kernels
from nemo_dcr.runtimes import scatter
from nemo_dcr.runtimes.scatter import ADD, XOR, Job, ScatterPool

pytestmark = pytest.mark.skipif(not kernels.common.HAVE_NUMBA, reason="the pool runs the compiled scatter")


def _jobs(seed: int, n_jobs: int = 6, size: int = 5000, dtype=np.uint16):
    rng = np.random.default_rng(seed)
    flats, jobs = [], []
    for j in range(n_jobs):
        flat = rng.integers(0, np.iinfo(dtype).max, size, dtype=dtype, endpoint=True)
        k = int(rng.integers(0, size // 3))
        pos = np.sort(rng.choice(size, k, replace=False)).astype(np.int64 if j % 2 else np.uint32)
        vals = rng.integers(0, np.iinfo(dtype).max, k, dtype=dtype, endpoint=True)
        flats.append(flat)
        jobs.append(Job(flat, pos, vals, ADD if j % 3 else XOR))
    return flats, jobs


def _expected(flats, jobs):
    out = [f.copy() for f in flats]
    for o, job in zip(out, jobs):
        with np.errstate(over="ignore"):
            if job.op == XOR:
                o[job.positions.astype(np.int64)] ^= job.values
            else:
                o[job.positions.astype(np.int64)] += job.values
    return out


def _assert_equal(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), f"destination {j}"


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("piece", [1, 7, 64, 1 << 17])
def test_same_bits_as_one_thread(threads, piece):
    flats, jobs = _jobs(seed=threads * 100 + piece)
    want = _expected(flats, jobs)
    assert ScatterPool(threads, piece=piece).run(jobs) == [True] * len(jobs)
    _assert_equal(flats, want)


@pytest.mark.parametrize("where", ["inside a piece", "at a seam", "past the end", "in the last piece"])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_bad_job_is_taken_back_whole_and_the_others_applied(where, threads):
    flats, jobs = _jobs(seed=5, size=6000)
    jobs[2] = Job(jobs[2].flat, np.sort(np.random.default_rng(1).choice(6000, 1500, replace=False)).astype(np.int64),
                  np.full(1500, 0x8001, np.uint16), ADD)
    pos = jobs[2].positions
    piece = 100
    if where == "inside a piece":
        pos[750] = pos[749]
    elif where == "at a seam":  # the last of one piece, the first of the next
        pos[700] = pos[699]
    elif where == "past the end":
        pos[-1] = 6000
    else:
        pos[1450] = pos[1449] - 1
    before = [f.copy() for f in flats]
    want = _expected(flats[:2] + flats[3:], jobs[:2] + jobs[3:])
    want.insert(2, None)
    got = ScatterPool(threads, piece=piece).run(jobs)
    assert got == [True, True, False, True, True, True]
    _assert_equal(flats, [b if j == 2 else w for j, (w, b) in enumerate(zip(want, before))])


def test_an_exception_takes_back_every_job():
    flats, jobs = _jobs(seed=9)
    before = [f.copy() for f in flats]
    # values of another width than the destination: the kernel's dispatch raises
    jobs[3] = Job(jobs[3].flat, jobs[3].positions, jobs[3].values.astype(np.float32), XOR)
    with pytest.raises(Exception):
        ScatterPool(3, piece=50).run(jobs)
    _assert_equal(flats, before)


def test_a_pool_runs_again_and_empty_jobs():
    pool = ScatterPool(2, piece=16)
    flats, jobs = _jobs(seed=2)
    want = _expected(flats, jobs)
    pool.run(jobs)
    assert pool.run([]) == []
    empty = Job(np.zeros(4, np.uint16), np.zeros(0, np.int64), np.zeros(0, np.uint16), XOR)
    assert pool.run([empty]) == [True]
    _assert_equal(flats, want)


def test_a_closed_pool_lets_its_threads_go_and_runs_again():
    pool = ScatterPool(3, piece=16)
    flats, jobs = _jobs(seed=4)
    want = _expected(flats, jobs)
    pool.run(jobs[:3])
    helpers = list(pool._pool._threads)  # this pool's (other tests' pools have threads of the same name)
    assert helpers and all(t.name.startswith("dcr-apply") for t in helpers)
    pool.close()
    for t in helpers:
        t.join(10)
    assert not any(t.is_alive() for t in helpers)
    assert pool.run(jobs[3:]) == [True] * 3  # new threads
    pool.close()
    _assert_equal(flats, want)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_thread_counts_are_checked(bad):
    with pytest.raises(ValueError, match="positive integer"):
        ScatterPool(bad)
    with pytest.raises(ValueError, match="positive integer"):
        scatter.resolve_threads(bad)


def test_default_threads_is_the_cores_at_most_eight():
    assert 1 <= scatter.default_threads() <= 8
    assert scatter.resolve_threads(None) == scatter.default_threads()


def test_processes_sharing_the_cores_get_their_part(monkeypatch):
    monkeypatch.setattr(scatter.os, "sched_getaffinity", lambda pid: set(range(96)))
    assert scatter.default_threads() == 8  # at most eight
    assert scatter.default_threads(8) == 8 and scatter.default_threads(16) == 6 and scatter.default_threads(96) == 1
    assert scatter.default_threads(500) == 1 and scatter.default_threads(0) == 8
    assert scatter.default_threads(cap=None) == 96 and scatter.default_threads(8, cap=None) == 12  # decoding
