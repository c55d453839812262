"""The producer's reusable concatenation memory (`Arena`): one job, its own module."""

from __future__ import annotations

import numpy as np


class Arena:
    """Memory the payload builder concatenates into, reused from payload to payload and
    from refit to refit. Fresh pages cost more than the copy: touching a page for the
    first time is a page fault, and on a VM a copy into fresh memory took ~10x as long as
    one into memory already touched (docs/design-notes.md, "Producer memory"). take()
    sizes it for the payload at hand (10 bytes per BF16 change: int64 position and value;
    12 with new bits); it keeps the largest size seen, about `max_payload_elements` plus
    one chunk's changes."""

    ALIGN = 64

    def __init__(self):
        self.buf = np.empty(0, np.uint8)
        self.used = 0

    def reset(self, nbytes: int = 0) -> Arena:
        """Hand the whole arena out again, at least `nbytes` of it: what earlier calls
        returned is overwritten."""
        self.used = 0
        if nbytes > self.buf.size:
            self.buf = np.empty(max(nbytes, self.buf.size + self.buf.size // 4), np.uint8)
        return self

    def empty(self, n: int, dtype) -> np.ndarray:
        """n uninitialised elements of `dtype` from the arena."""
        dtype = np.dtype(dtype)
        start = -(-self.used // self.ALIGN) * self.ALIGN
        end = start + n * dtype.itemsize
        if end > self.buf.size:  # a larger buffer; arrays handed out keep the old one alive
            self.reset(end - start)
            start, end = 0, end - start
        self.used = end
        return self.buf[start:end].view(dtype)

    def concatenate(self, arrays: list[np.ndarray], dtype=None) -> np.ndarray:
        """np.concatenate(arrays) into the arena, as `dtype` (default: the arrays'); one
        array already of that dtype is itself, and arrays of it that lie end to end in one
        buffer (the diff's chunks, `diff.DiffOutput`) are one view of it: neither is copied."""
        dtype = np.dtype(arrays[0].dtype if dtype is None else dtype)
        if len(arrays) == 1 and arrays[0].dtype == dtype:
            return arrays[0]
        joined = end_to_end(arrays, dtype)
        if joined is not None:
            return joined
        # unsafe: int64 positions (never negative) go to uint64 as astype() would take them
        return np.concatenate(arrays, out=self.empty(sum(a.size for a in arrays), dtype), casting="unsafe")


def end_to_end(arrays: list[np.ndarray], dtype: np.dtype) -> np.ndarray | None:
    """One view of the memory `arrays` (1-D, all of `dtype`) cover when each starts where
    the one before ends, inside one contiguous buffer that owns it; else None."""
    arrays = [a for a in arrays if a.size] or arrays[:1]  # an empty view may point anywhere
    owner = arrays[0].base
    if not isinstance(owner, np.ndarray) or not owner.flags.c_contiguous:
        return None
    at = arrays[0].ctypes.data
    for a in arrays:
        if a.dtype != dtype or a.base is not owner or not a.flags.c_contiguous or a.ctypes.data != at:
            return None
        at += a.nbytes
    start = arrays[0].ctypes.data - owner.ctypes.data
    return owner.reshape(-1).view(np.uint8)[start:at - owner.ctypes.data].view(dtype)
