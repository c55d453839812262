"""The hot loop: changed positions and their xor / add / new values, vectorised.

Works on integer bit views (int16 for BF16), so NaNs, -0.0 and every other bit
pattern compare by their stored bits. Runs on whatever device the tensors are on.

CPU fast path with numba (`diff_arrays`, the producer's path; `diff` and
`_diff_compiled` use it too): one compiled pass writes the positions, the new bits and
the values the records carry (xor, add or the committed bits) into preallocated
buffers, keeping only the changed elements (with a `DiffOutput`, the chunks of one range
end to end in the same buffers). 16-bit inputs (BF16, F16) on an AVX-512 host
take `kernels.diff.diff16`: 128 elements per block, four 512-bit compares, and compress-stores
for the blocks that differ - no branch per element, close to the speed of a memory-bound
two-input scan at 0-0.1% changes and somewhat below it at 1-5%, where the compresses and
stores come on top of the reads. Other hosts take `kernels.diff.diff16_bitscan`: the same
compares, and each block's masks walked bit by bit (one element's writes per change).
Other widths take `kernels.diff.diff_words` (int64 words, 32 per block, an OR skips clean
blocks) plus one vectorised pass per value array. Without numba, the numpy path
(`_diff_cpu_words`) gives the same arrays: elements narrower than 8 bytes are compared
as int64 words (4 BF16 elements per compare), the word mask is scanned 8 words at a time
(one uint64 view of 8 bools), and only the words that differ are split back into
elements; on one core it runs at about half the memcpy bandwidth. Other devices (CUDA)
take the plain `ne().nonzero()` path, which is what the GPU is good at.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import kernels


@dataclass
class Delta:
    positions: torch.Tensor  # int64, sorted, relative to the diffed slice
    new: torch.Tensor  # new bits at positions
    old: torch.Tensor  # committed bits at positions

    def xor(self) -> torch.Tensor:
        return torch.bitwise_xor(self.new, self.old)

    def add(self) -> torch.Tensor:
        # Two's-complement wrap-around: (new - old) mod 2**width on the bit view.
        return self.new - self.old

    def __len__(self) -> int:
        return int(self.positions.numel())


_NP_OF_TORCH = {torch.int16: np.int16, torch.int32: np.int32, torch.uint8: np.uint8, torch.int8: np.int8}


def diff(current: torch.Tensor, committed: torch.Tensor) -> Delta:
    """Positions where the bits of `current` differ from `committed` (same shape/dtype)."""
    if current.shape != committed.shape or current.dtype != committed.dtype:
        raise ValueError(
            f"diff needs equal shapes and dtypes, got {tuple(current.shape)}/{current.dtype} "
            f"vs {tuple(committed.shape)}/{committed.dtype}"
        )
    if (current.device.type == "cpu" and committed.device.type == "cpu" and current.dtype in _NP_OF_TORCH
            and current.numel() >= 64 and current.is_contiguous() and committed.is_contiguous()):
        a = current.detach().reshape(-1).numpy()
        b = committed.detach().reshape(-1).numpy()
        pos, new, old = _diff_compiled(a, b) if kernels.common.HAVE_NUMBA else _diff_cpu_words(a, b)
        return Delta(torch.from_numpy(pos), torch.from_numpy(new), torch.from_numpy(old))
    positions = torch.ne(current, committed).nonzero().view(-1)
    return Delta(positions, current[positions], committed[positions])


def _diff_cpu_words(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions int64, new, old) for 1-D numpy arrays of one integer dtype (< 8 bytes)."""
    per = 8 // a.itemsize  # elements per int64 word
    nw = a.size // per
    aw = a[:nw * per].view(np.int64)
    bw = b[:nw * per].view(np.int64)
    mask = np.not_equal(aw, bw)
    # Words that differ: scan the bool mask 8 words at a time through a uint64 view.
    n8 = nw // 8 * 8
    groups = np.flatnonzero(mask[:n8].view(np.uint64))
    if groups.size:
        sub = np.flatnonzero(mask[:n8].reshape(-1, 8)[groups])
        words = groups[sub >> 3] * 8 + (sub & 7)
    else:
        words = np.empty(0, dtype=np.int64)
    tail_words = np.flatnonzero(mask[n8:]) + n8
    if tail_words.size:
        words = np.concatenate((words, tail_words))
    # Split the differing words back into elements.
    na = aw[words].view(a.dtype)
    ob = bw[words].view(a.dtype)
    hit = np.flatnonzero(na != ob)
    shift = per.bit_length() - 1  # per is 1, 2, 4 or 8
    pos = (words[hit >> shift] << shift) | (hit & (per - 1))
    new, old = na[hit], ob[hit]
    rest = nw * per
    if rest < a.size:  # the last elements that do not fill a word
        t = np.flatnonzero(a[rest:] != b[rest:])
        if t.size:
            pos = np.concatenate((pos, t + rest))
            new = np.concatenate((new, a[rest:][t]))
            old = np.concatenate((old, b[rest:][t]))
    return pos.astype(np.int64, copy=False), np.ascontiguousarray(new), np.ascontiguousarray(old)


def _diff_compiled(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_diff_cpu_words` as one compiled pass (nemo_dcr.kernels); same output."""
    pos, new, (old,) = diff_arrays(a, b, ("old",))
    return pos, new, old


_MODES = {("old",): kernels.diff.DIFF_OLD, ("xor",): kernels.diff.DIFF_XOR, ("add",): kernels.diff.DIFF_ADD,
          (): kernels.diff.DIFF_NONE}


@dataclass(frozen=True)
class Rows:
    """Row skips for `diff_arrays` positions: an element at index i >= `end` has its position
    `skip` larger for every row end at or before it - `end`, `end + length`, ... - so a
    chunk of a local tensor whose rows lie apart in the canonical tensor (a row-parallel
    shard's) gets canonical positions from the diff itself (`kernels.diff.diff16`'s rows)."""

    end: int
    length: int
    skip: int

    def fits_blocks(self) -> bool:
        """Whether every row ends on a DIFF_BLOCK boundary (the scans check rows a block at a time)."""
        return self.end >= 0 and self.length > 0 and self.end % kernels.diff.DIFF_BLOCK == 0 \
            and self.length % kernels.diff.DIFF_BLOCK == 0

    def position(self, index, base: int = 0) -> np.ndarray:
        """base + index plus its row skips, as int64 (an array of indices, or one index)."""
        idx = np.asarray(index, dtype=np.int64)
        ends = np.where(idx >= self.end, (idx - self.end) // self.length + 1, 0)
        return base + idx + ends * self.skip

    def index(self, positions: np.ndarray, base: int = 0) -> np.ndarray:
        """The indices (int64) whose `position(index, base)` are `positions`: the inverse."""
        d = positions.astype(np.int64) - base
        after = d - self.end - self.skip  # counted from the second row's start
        period = self.length + self.skip
        return np.where(d < self.end, d, self.end + after // period * self.length + after % period)


@dataclass(frozen=True)
class DiffCoordinates:
    """The coordinates a 16-bit diff of one chunk wrote its positions in, when they are
    not the range's own: the chunk starts at element `lo` of its range, and the diff was
    given `base` and `rows` (`diff_arrays`), so that it wrote canonical positions. The
    baseline keeps the range's (`range_positions`, at its commit)."""

    lo: int
    base: int
    rows: Rows | None

    def range_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The range-relative positions of the diff's `positions` (int64)."""
        pos = positions.numpy()
        index = pos.astype(np.int64) - self.base if self.rows is None else self.rows.index(pos, self.base)
        return torch.from_numpy(index + self.lo)


class DiffOutput:
    """Where successive `diff_arrays` calls over the chunks of one range write, end to end:
    each call's arrays are views that directly follow the previous call's in the same
    buffers, so that consecutive chunks' changes can be taken as one view instead of being
    copied together (the payload builder does: `arena.Arena.concatenate`). A chunk that
    does not fit moves to new, larger buffers; buffers are never resized in place, so the
    views handed out stay valid. Used by the 16-bit vector scan; other paths ignore it."""

    def __init__(self, elements: int):
        self.left = elements  # elements of the range not diffed yet: sizes fresh buffers
        self.bufs: list[np.ndarray] | None = None  # positions, new bits, value arrays
        self.fill = 0  # slots used

    def take(self, kind: tuple, chunk: int) -> tuple[list[np.ndarray] | None, int]:
        """(buffers, first free slot) for a chunk of `chunk` elements whose arrays are of
        `kind` (dtypes); (None, 0) when the buffers are of another kind (or none yet)."""
        self.left = max(self.left - chunk, 0)
        if self.bufs is None or tuple(b.dtype for b in self.bufs) != kind:
            return None, 0
        return self.bufs, self.fill


def diff_arrays(a: np.ndarray, b: np.ndarray, values: tuple[str, ...] = ("old",), base: int = 0,
                narrow: bool = False, out: DiffOutput | None = None, rows: Rows | None = None
                ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Changed positions of 1-D integer arrays a (new bits) vs b (committed bits), as one
    compiled pass (requires numba).

    Returns (positions int64 + `base`, new bits, [one array per entry of `values`]), where
    `values` is one of (), ("old",), ("xor",), ("add",): the committed bits, new ^ old,
    or new - old wrapping around (two's complement, on the bit view).
    Every array has a's dtype except the positions. `narrow`: int32 positions from the
    16-bit scan when base + len(a) < 2**31 (half its position compress-stores; callers
    widen them where they copy anyway). 16-bit inputs take `kernels.diff.diff16` on an
    AVX-512 host, `kernels.diff.diff16_bitscan` elsewhere (either scan writes the values
    itself); other widths the word scan `kernels.diff.diff_words` plus one vectorised pass per
    value array.
    `out`: the 16-bit scan writes there, after what earlier calls wrote (see DiffOutput).
    `rows`: positions with row skips (16-bit inputs only; see Rows)."""
    if values not in _MODES:
        raise ValueError(f"unsupported values {values!r}")
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    size = a.size
    if rows is not None and (a.itemsize != 2 or not rows.fits_blocks()):
        raise ValueError(f"rows {rows} need 16-bit arrays and row ends on {kernels.diff.DIFF_BLOCK}-element blocks")
    if a.itemsize == 2:
        # Positions with `base` added by the scan itself; int32 ones (narrow) take two
        # compresses per 32 elements where int64 ones take four (diff16), and half the bytes.
        top = base + size if rows is None else int(rows.position(size - 1, base)) + 1
        pdt = np.int32 if narrow and top < (1 << 31) else np.int64
        kind = (np.dtype(pdt),) + (a.dtype,) * (1 + len(values))
        mode = _MODES[values]
        bufs, start = out.take(kind, size) if out is not None else (None, 0)
        # Room for ~1 change in 16 elements (grown when short); with `out`, for the rest of the range.
        cap = max(1024, (size + (out.left if out is not None else 0)) >> 4)
        if bufs is None:
            bufs = [np.empty(cap, t) for t in kind]
        empty = np.empty(0, a.dtype)

        scan = kernels.diff.diff16 if kernels.diff.HAVE_VECTOR_DIFF else kernels.diff.diff16_bitscan

        row_args = kernels.diff.NO_ROWS if rows is None else (rows.end, rows.length, rows.skip)

        def call(i, n):
            return scan(a, b, i, base, bufs[0], bufs[1], bufs[2] if values else empty, mode, n, *row_args)

        def grow(n, room):
            """This chunk's slots so far [start, n) at the front of new buffers with `room` more."""
            nonlocal bufs, start
            bufs = [np.concatenate((x[start:n], np.empty(max(cap, room), x.dtype))) for x in bufs]
            n, start = n - start, 0
            return n

        n, i = call(0, start)
        while i < size - size % kernels.diff.DIFF_BLOCK:
            n, i = call(i, grow(n, min(2 * (n - start), size - i) + kernels.diff.DIFF_BLOCK))
        if i < size:  # the tail after the last whole block
            t = np.flatnonzero(a[i:] != b[i:])
            if t.size:
                if n + t.size > bufs[0].size:
                    n = grow(n, t.size)
                x, y = a[i:][t], b[i:][t]
                at = t + (base + i) if rows is None else rows.position(t + i, base)
                for buf, u in zip(bufs, [at, x] + [_values_of(x, y, k) for k in values]):
                    buf[n:n + t.size] = u
                n += t.size
        res = [x[start:n] for x in bufs]
        if out is not None:
            out.bufs, out.fill = bufs, n
    else:
        cap = max(1024, size >> 4)  # grown (doubled) when the changes do not fit
        pos, new, old = _diff_words_compiled(a, b, cap)
        if base:
            pos += base
        res = [pos, new] + [_values_of(new, old, k) for k in values]
    return res[0], res[1], res[2:]


def _values_of(new: np.ndarray, old: np.ndarray, kind: str) -> np.ndarray:
    if kind == "old":
        return old
    return np.bitwise_xor(new, old) if kind == "xor" else np.subtract(new, old)  # arrays wrap around


def _diff_words_compiled(a: np.ndarray, b: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, new, old) through the compiled word scan `kernels.diff.diff_words`."""
    per = 8 // a.itemsize
    nw = a.size // per
    aw = a[:nw * per].view(np.int64)
    bw = b[:nw * per].view(np.int64)
    pos = np.empty(cap, np.int64)
    new = np.empty(cap, a.dtype)
    old = np.empty(cap, a.dtype)
    n, w = kernels.diff.diff_words(a, b, aw, bw, per, 0, pos, new, old, 0)
    while w < nw:
        cap = min(2 * cap, a.size + per)
        pos, new, old = (np.concatenate((x[:n], np.empty(cap - n, x.dtype))) for x in (pos, new, old))
        n, w = kernels.diff.diff_words(a, b, aw, bw, per, w, pos, new, old, n)
    rest = nw * per
    if rest < a.size:  # the last elements that do not fill a word
        t = np.flatnonzero(a[rest:] != b[rest:])
        if t.size:
            pos = np.concatenate((pos[:n], t + rest))
            new = np.concatenate((new[:n], a[rest:][t]))
            old = np.concatenate((old[:n], b[rest:][t]))
            n = pos.size
    return pos[:n], new[:n], old[:n]
