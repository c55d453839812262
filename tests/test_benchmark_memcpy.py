"""benchmarks/memcpy.py: the memcpy reference copies between page-aligned buffers, whatever
the process's heap did before (a few bytes between source and destination modulo 4 KiB
cost some hosts three quarters of the copy)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.memcpy import PAGE, memcpy_gbs, page_aligned, touched_pair


@pytest.mark.parametrize("dtype", [np.int16, np.uint32, np.uint8])
@pytest.mark.parametrize("elements", [1, 1000, 3 * PAGE + 5])
def test_page_aligned_arrays_start_a_page(dtype, elements):
    arrays = [page_aligned(elements, dtype) for _ in range(4)]
    for a in arrays:
        assert a.ctypes.data % PAGE == 0 and a.dtype == dtype and a.shape == (elements,)
        assert a.flags.c_contiguous and a.flags.writeable
    assert not any(np.shares_memory(a, b) for i, a in enumerate(arrays) for b in arrays[i + 1:])


def test_touched_pair_copies_between_aligned_buffers():
    src, dst = touched_pair(5000)
    assert (src == 1).all() and (dst == 0).all() and not np.shares_memory(src, dst)
    assert src.ctypes.data % PAGE == 0 and dst.ctypes.data % PAGE == 0
    wall, cpu = memcpy_gbs(src, dst, 2)
    assert (dst == 1).all() and wall > 0 and cpu > 0
