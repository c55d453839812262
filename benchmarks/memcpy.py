"""The memcpy reference of the benchmarks: `np.copyto` between two page-aligned buffers on
one core.

Where the two buffers start relative to each other moves the copy: on an AMD Zen 3 core a
256 MiB copy read 15 GB/s with the destination 0, 1 KiB or 8 KiB past the source modulo
4 KiB, and 3.5-4.5 GB/s with it 16 or 64 bytes past (consistent with 4K aliasing: a load
whose address matches an earlier store's low 12 bits waits on it). Where two fresh numpy
arrays land depends on the process's heap (an end-to-end run read 3.7-4.0 GB/s where the
same copy in a fresh process read 13-16), so the buffers here start on a page each and the
reference is the copy at its fast placement.
"""

from __future__ import annotations

import time

import numpy as np

PAGE = 4096


def page_aligned(elements: int, dtype=np.int16) -> np.ndarray:
    """An uninitialised array of `elements` of `dtype` whose first byte starts a page."""
    dt = np.dtype(dtype)
    raw = np.empty(elements * dt.itemsize + PAGE, np.uint8)
    skip = -raw.ctypes.data % PAGE
    return raw[skip:skip + elements * dt.itemsize].view(dt)


def touched_pair(elements: int, dtype=np.int16) -> tuple[np.ndarray, np.ndarray]:
    """A page-aligned source and destination of `elements`, every page touched before timing."""
    src, dst = page_aligned(elements, dtype), page_aligned(elements, dtype)
    src[:] = 1
    dst[:] = 0
    return src, dst


def memcpy_gbs(src: np.ndarray, dst: np.ndarray, repeats: int) -> tuple[float, float]:
    """(wall-clock GB/s, CPU-time GB/s) of np.copyto, best of `repeats` each."""
    best = best_cpu = float("inf")
    for _ in range(repeats):
        t, c = time.perf_counter(), time.thread_time()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.thread_time() - c)
    return src.nbytes / best / 1e9, src.nbytes / max(best_cpu, 1e-9) / 1e9
