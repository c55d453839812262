"""Decoding a baseline-conditioned record's positions with torch ops on the device that
holds the receiver's committed bits (nemo_dcr.wire.conditioned; docs/wire-format.md,
"Conditioned records").

`conditioned.decode_conditioned` walks the universe once on the host (one compiled pass:
an element is a change when its class's pending Golomb gap is used up). That pass reads
every old element, which on a receiver whose weights sit on a GPU means a device-to-host
copy of the universe first. Here the universe never leaves the device:

1. the classes of the universe, (bits >> shift) & mask, one elementwise op there;
2. a stable sort of the classes: the universe's indices grouped by class, each class's
   in universe order - so the r-th element of class c is sorted[class_start[c] + r];
3. the per-class Golomb gap streams decoded on the host (`class_ranks`: small, the
   changes' count, not the universe's) into each change's rank within its class;
4. position = lo + sorted[class_start[c] + rank], gathered and sorted on the device;
5. the values: conditioned's host rANS decoder, which needs each change's class in
   position order (taken from the device result: one byte a change to the host).

Results and errors are those of `decode_conditioned` bit for bit, messages included: the
checks the host pass makes while it walks (a stream that ends early, a class with more
changes than elements here) are replayed from the decoded ranks and the class totals
(`_status`), in the order the host pass would meet them.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import dtypes
from ..kernels.common import jit
from ..kernels.conditioned import _golomb_read
from ..records import Op
from .conditioned import CLASS_FIELDS, _decode_values, read_class_streams
from .errors import PositionsError

# A rank past any universe (they are < 2**62): a decoded rank saturates here rather than
# wrap, and the check against the class's total then fails as the host pass does.
_RANK_CAP = np.int64(1) << 62


class ClassGaps:
    """A conditioned positions section read on the host: per class its change count, its
    Golomb parameter and its stream's bytes, and (`ranks`) the changes' ranks within their
    classes - class by class, ascending, each class's in order."""

    __slots__ = ("ncls", "counts", "m", "start", "end", "stream", "ranks", "read", "clean")

    def __init__(self, psec, count: int, dt: dtypes.DType):
        """Parse the section as `decode_conditioned` does (same checks, same messages)
        and decode every class's gaps; nothing here needs the universe."""
        _, cmask = CLASS_FIELDS[dt.name]
        ncls = self.ncls = cmask + 1
        kc, m, self.start, self.end, self.stream = read_class_streams(psec, count, ncls)
        self.counts, self.m = kc, m
        self.ranks = np.empty(count, np.int64)
        self.read = np.zeros(ncls, np.int64)  # per class: the gaps its stream gave before it ended
        self.clean = np.zeros(ncls, np.bool_)  # per class: only zero padding after its last gap
        class_ranks(kc, m, self.start, self.end, self.stream, self.ranks, self.read, self.clean)

    def status(self, totals: np.ndarray) -> int:
        """`golomb_positions`' status for a universe holding `totals[c]` elements of each
        class: the change count, -1 or -2 (see `_status`)."""
        return _status(self.counts, self.ranks, self.read, self.clean, totals)


@jit
def class_ranks(counts, m, start_byte, end_byte, buf, ranks_out, read_out, clean_out):
    """Each class's Golomb stream decoded on its own: ranks_out, class by class ascending,
    holds each change's rank among its class's elements (the previous one's + its gap + 1,
    saturating at _RANK_CAP). read_out[c]: the gaps read before the stream ended (counts[c]
    when none was missing); clean_out[c]: whether only zero bits of its last byte follow
    the last gap (as golomb_positions checks at the end)."""
    j = 0
    for c in range(counts.size):
        k = counts[c]
        if k == 0:
            continue
        mc = m[c]
        b = 0
        while (np.int64(1) << b) < mc:
            b += 1
        u = (np.int64(1) << b) - mc
        at = start_byte[c] << 3
        end_bit = end_byte[c] << 3
        rank = np.int64(-1)
        got = 0
        while got < k:
            g, at = _golomb_read(buf, at, end_bit, mc, b, u)
            if g < 0:
                break
            rank = rank + g + 1
            if rank > _RANK_CAP or rank < 0:
                rank = _RANK_CAP
            ranks_out[j + got] = rank
            got += 1
        for t in range(got, k):
            ranks_out[j + t] = _RANK_CAP
        read_out[c] = got
        ok = got == k and (at + 7) >> 3 == end_byte[c]
        if ok:
            while at < end_bit:
                if (buf[at >> 3] >> (7 - (at & 7))) & 1:
                    ok = False
                    break
                at += 1
        clean_out[c] = ok
        j += k


def _status(counts: np.ndarray, ranks: np.ndarray, read: np.ndarray, clean: np.ndarray,
            totals: np.ndarray) -> int:
    """What `kernels.conditioned.golomb_positions` returns for these streams over a universe
    of `totals` elements per class, without its pass: -1 when a stream ends before a gap
    the pass reads (it reads gap i + 1 once change i is placed, so only while the class's
    elements last), else, class by class ascending, -2 when a class's changes do not all
    fit its elements, -1 when its stream has bits after its last gap; else the count."""
    ends = np.cumsum(counts)
    firsts = ends - counts
    for c in np.flatnonzero(counts):
        f = int(read[c])
        if f < counts[c] and (f == 0 or ranks[firsts[c] + f - 1] < totals[c]):
            return -1
    for c in np.flatnonzero(counts):
        if read[c] < counts[c] or ranks[ends[c] - 1] >= totals[c]:
            return -2
        if not clean[c]:
            return -1
    return int(counts.sum())


def element_classes(bits: torch.Tensor, dt: dtypes.DType) -> torch.Tensor:
    """The class (old exponent field) of each element of a 16-bit universe, as uint8, on
    its device. `bits`: the committed bits as any 2-byte tensor (int16, uint16, or the
    BF16 / F16 weights themselves)."""
    if bits.element_size() != 2:
        raise ValueError(f"conditioned classes need 2-byte elements, got {bits.dtype}")
    shift, cmask = CLASS_FIELDS[dt.name]
    v = bits.reshape(-1).view(torch.int16)
    return ((v >> shift) & cmask).to(torch.uint8)  # arithmetic shift: the mask drops the sign's copies


def decode_positions_device(psec, count: int, dt: dtypes.DType, lo: int, bits: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions as int64, each change's class as uint8), both on `bits`' device and in
    position order, of a conditioned record whose universe is canonical positions lo ..
    lo + bits.numel() with these committed bits. Raises PositionsError as
    `decode_conditioned` does."""
    gaps = ClassGaps(psec, count, dt)
    dev = bits.device
    cls_u = element_classes(bits, dt)
    totals = torch.bincount(cls_u, minlength=gaps.ncls)
    status = gaps.status(totals.cpu().numpy().astype(np.int64))
    if status == -2:
        raise PositionsError("conditioned positions: more changes than the universe's elements of a class "
                             "(a baseline other than the producer's, or a corrupt section)")
    if status != count:
        raise PositionsError("conditioned positions: a class's Golomb stream is cut short or has trailing bits")
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=dev), torch.empty(0, dtype=torch.uint8, device=dev)
    # The universe's indices grouped by class, each class's in universe order.
    order = torch.sort(cls_u, stable=True).indices
    class_start = torch.cumsum(totals, 0) - totals
    used = np.flatnonzero(gaps.counts)
    cls_of = torch.repeat_interleave(torch.from_numpy(used.astype(np.uint8)),
                                     torch.from_numpy(gaps.counts[used])).to(dev)
    ranks = torch.from_numpy(gaps.ranks).to(dev)
    where = order[class_start[cls_of.to(torch.int64)] + ranks]
    pos, by = torch.sort(where)
    return pos + lo if lo else pos, cls_of[by]


def decode_conditioned_device(psec, vsec, count: int, dt: dtypes.DType, op: Op, lo: int, bits: torch.Tensor
                              ) -> tuple[torch.Tensor, np.ndarray]:
    """(positions as int64 on `bits`' device, values as 16-bit bits on the host) of a
    conditioned record: what `conditioned.decode_conditioned(psec, vsec, count, dt, op,
    BaseSpan(lo, bits))` gives (positions there: uint64 on the host), and its errors."""
    pos, cls = decode_positions_device(psec, count, dt, lo, bits)
    cls_h = cls.cpu().numpy().astype(np.int64)
    return pos, _decode_values(np.asarray(vsec, np.uint8), count, op is Op.ADD, cls_h, CLASS_FIELDS[dt.name][1] + 1)
