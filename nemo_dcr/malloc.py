"""Keep memory a process frees for its next refit, instead of handing it back to the OS.

A receiver stages a whole transfer (decoded positions and values, ~10 bytes per change)
and frees it after the commit. glibc's malloc returns most of that to the OS (large
blocks are unmapped, the heap's free top is trimmed), so the next refit touches the
same amount of fresh memory again: one page fault per 4 KiB, which on a VM costs about
as much as the copy into it. Measured: staging a few hundred MB and freeing it took about
twice as long a round as with the memory kept (docs/design-notes.md, "Producer memory").

`keep_freed_memory()` fixes glibc's mmap threshold at 32 MiB (blocks below it come from
the heap, whose free memory is reused) and raises the trim threshold to 2 GiB (the heap
keeps up to that much free memory). The process then stays at its high-water mark
between refits. `nemo-dcr receive` calls it (opt out with `--release-memory`); a
trainer process may call it too, and should when its producer encodes on threads
(`encode_threads`: each thread's malloc arena would hand every payload's memory back).
It is process-wide, so a library embedded in someone else's process (vLLM, NeMo RL)
does not call it on its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse; False where the C library is not
    glibc (nothing changed)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: musl and others differ in what mallopt does
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
