"""Placement algebra: fixed, bit-preserving index maps from training shards to
canonical (Hugging Face checkpoint) coordinates.

A local parameter's flat index space is covered by `Piece`s. Each piece is a
row-major block of `rows x cols` local elements, contiguous in local flat order,
whose element (r, c) lands at canonical flat index `offset + r * row_stride + c`
of one canonical tensor. Every tensor-parallel split Megatron uses (column, row,
vocab, fused QKV, fused gate/up) is a handful of such pieces per parameter, so
mapping a sorted array of changed local positions is a few vectorised integer
operations per piece. Local elements covered by no piece are dropped on purpose
(vocab padding, replicas owned by another rank); the converter declares why.

What no index map can express (value transforms such as `1 + w` norms, FP8
weights and their scales) is a `ResidualMap`: a function recomputes canonical
values from the whole TP-local parameter into one flat *output* per target slice,
and each output is placed by its own `AffineMap` (output flat index -> canonical).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from nemo_dcr import kernels
from nemo_dcr.diff import DiffOutput, Rows

_INT32 = np.iinfo(np.int32)


@dataclass(frozen=True)
class Piece:
    canonical: str
    local_start: int
    rows: int
    cols: int
    offset: int  # canonical flat index of local element (0, 0) of the block
    row_stride: int  # canonical distance between consecutive block rows

    @property
    def size(self) -> int:
        return self.rows * self.cols

    @property
    def local_stop(self) -> int:
        return self.local_start + self.size

    @property
    def monotone(self) -> bool:
        """Whether increasing local indices map to strictly increasing canonical ones."""
        return self.rows <= 1 or self.row_stride >= self.cols

    @property
    def canonical_stop(self) -> int:
        """One past the largest canonical flat index of the piece."""
        return self.offset + (self.rows - 1) * self.row_stride + self.cols if self.rows else self.offset

    def canonical_index(self, local: np.ndarray, shift: int = 0, slots: PositionSlots | None = None,
                        slot: int = 0) -> np.ndarray:
        """Canonical flat indices of local flat indices `local + shift` inside this piece:
        int64, or int32 when `local` is (the producer's diff gives int32 positions) and
        the piece's canonical indices stay below 2**31 (the narrower arrays cost less to
        write, concatenate and code).

        A piece whose block rows lie end to end in canonical order (one row, or a row
        stride equal to its width) maps by a constant shift; when that shift is 0 (the
        piece sits where the local tensor does) the result is `local` itself, not a copy:
        callers do not write to it. `slots`: where the compiled row mapping writes, in the
        buffer of `slot`, instead of a new array (the producer's, so that successive
        chunks' indices lie end to end: `PositionSlots`).

        `local` may also be a torch tensor, on any device: the indices are then computed
        there, as int64 (the producer's device coding, format v6)."""
        start = self.local_start - shift
        if isinstance(local, torch.Tensor):
            rel = local.to(torch.int64) - start
            if self.rows <= 1 or self.row_stride == self.cols:
                return rel + self.offset
            return self.offset + torch.div(rel, self.cols, rounding_mode="floor") * self.row_stride + rel % self.cols
        out_dtype = np.int32 if local.dtype == np.int32 and self.canonical_stop <= _INT32.max else np.int64
        if local.dtype in (np.int64, np.int32) and (self.rows <= 1 or self.row_stride == self.cols):
            d = self.offset - start
            return local if d == 0 and local.dtype == out_dtype else np.add(local, d, dtype=out_dtype)
        if kernels.common.HAVE_NUMBA and local.dtype in (np.int64, np.int32) and local.ndim == 1:
            out = np.empty(local.size, out_dtype) if slots is None else slots.take(slot, local.size, out_dtype)
            kernels.place.affine_index(np.ascontiguousarray(local), start, self.cols, self.offset,  # one compiled pass
                                       self.row_stride, out)
            return out
        rel = local.astype(np.int64) - start
        r, c = np.divmod(rel, self.cols)
        return (self.offset + r * self.row_stride + c).astype(out_dtype, copy=False)

    def diff_rows(self, lo: int) -> tuple[int, Rows | None] | None:
        """(base, rows) with which a 16-bit diff of this piece's local elements from `lo` on
        gives their canonical positions itself (`diff.diff_arrays`: element k of the diffed
        range at base + k plus its row skips), or None when a block row's end would fall
        inside one of the diff's blocks (then the changes are placed after the diff).
        Contiguous pieces need no rows: one shift."""
        rel = lo - self.local_start
        row, col = divmod(rel, self.cols)
        base = self.offset + row * self.row_stride + col
        if self.rows <= 1 or self.row_stride == self.cols:
            return base, None
        rows = Rows(self.cols - col, self.cols, self.row_stride - self.cols)
        return (base, rows) if self.monotone and rows.fits_blocks() else None

    def canonical_runs(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Contiguous canonical runs (starts, lengths) covered by local range [lo, hi).

        Used for exact-cover checks without materialising indices: one run per
        touched block row.
        """
        lo, hi = max(lo, self.local_start), min(hi, self.local_stop)
        if hi <= lo:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        first_row = (lo - self.local_start) // self.cols
        last_row = (hi - 1 - self.local_start) // self.cols
        rows = np.arange(first_row, last_row + 1, dtype=np.int64)
        row_lo = np.maximum(self.local_start + rows * self.cols, lo)
        row_hi = np.minimum(self.local_start + (rows + 1) * self.cols, hi)
        return self.canonical_index(row_lo), row_hi - row_lo


@dataclass(frozen=True)
class AffineMap:
    """All pieces of one local parameter, sorted by local start, non-overlapping."""

    local_name: str
    numel: int
    pieces: tuple[Piece, ...]
    dropped_reason: str = ""  # why uncovered local elements are dropped
    _bounds: np.ndarray = field(init=False, repr=False, compare=False)  # the pieces' local starts, then stops

    def __post_init__(self):
        pieces = tuple(sorted(self.pieces, key=lambda p: p.local_start))
        object.__setattr__(self, "pieces", pieces)
        end = 0
        for p in pieces:
            if p.rows < 0 or p.cols <= 0 or p.local_start < end or p.local_stop > self.numel:
                raise ValueError(f"{self.local_name}: invalid or overlapping piece {p}")
            end = p.local_stop
        bounds = np.array([p.local_start for p in pieces] + [p.local_stop for p in pieces], dtype=np.int64)
        object.__setattr__(self, "_bounds", bounds)

    @property
    def covered(self) -> int:
        return sum(p.size for p in self.pieces)

    def place(self, local: np.ndarray) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """Map sorted local flat positions to canonical coordinates.

        Returns (canonical name, canonical positions, index into `local`) per
        touched piece; positions outside every piece are dropped. Pieces of the
        same canonical tensor are returned separately (callers merge and sort).
        """
        return [(name, cpos, np.arange(lo, hi)) for name, cpos, lo, hi, _ in self.place_spans(local)]

    def diff_placement(self, lo: int, hi: int) -> tuple[str, int, Rows | None] | None:
        """(canonical name, base, rows) with which a 16-bit diff of local elements [lo, hi)
        gives their canonical positions itself (Piece.diff_rows), when one piece holds all
        of them; else None."""
        for p in self.pieces:
            if p.local_start <= lo and hi <= p.local_stop:
                found = p.diff_rows(lo)
                return None if found is None else (p.canonical, *found)
        return None

    def place_spans(self, local: np.ndarray, shift: int = 0, slots: PositionSlots | None = None
                    ) -> list[tuple[str, np.ndarray, int, int, bool]]:
        """`place` for local positions `local + shift` (sorted), without materialising the
        source indices: (canonical name, canonical positions, lo, hi, monotone) per
        touched piece, where local[lo:hi] are the positions it places and `monotone`
        says the canonical positions are strictly increasing (Piece.monotone). `local`
        may be int64 or int32 (see Piece.canonical_index for the canonical positions').
        `slots`: where computed canonical positions go, piece i's in slot i (PositionSlots).
        `local` may also be an int64 torch tensor, on any device (the canonical positions
        are then tensors there)."""
        out = []
        if len(local) == 0:
            return out
        keys = self._bounds - shift
        if isinstance(local, torch.Tensor):
            found = torch.searchsorted(local, torch.from_numpy(keys).to(local.device)).cpu().numpy()
        else:
            if local.dtype == np.int32:  # else np.searchsorted would first copy `local` to int64
                # a few keys: clamped in Python (cheaper than np.clip's call, one per chunk)
                keys = np.array([min(max(k, _INT32.min), _INT32.max) for k in keys.tolist()], np.int32)
            found = np.searchsorted(local, keys, side="left")  # every piece's [lo, hi) in one call
        for i, p in enumerate(self.pieces):
            lo, hi = int(found[i]), int(found[len(self.pieces) + i])
            if hi > lo:
                out.append((p.canonical, p.canonical_index(local[lo:hi], shift, slots, i), lo, hi, p.monotone))
        return out


@dataclass(frozen=True)
class ResidualMap:
    """A local parameter whose canonical values are recomputed, not bit-copied.

    `forward(local)` takes the whole TP-local parameter (in its local shape) and
    returns one tensor per output, in the canonical dtype `dtypes[i]` (safetensors
    spelling) with `outputs[i].numel` elements; `outputs[i]` places output i's flat
    index in canonical coordinates. With `loading=False` the outputs hold the slices
    this TP/PP position *produces* (every canonical element by exactly one position;
    among the data-parallel replicas of that position, the rank whose owned range
    starts at local element 0 computes them, see `produced_by`); with `loading=True`
    every slice its shard *holds*. `inverse(outputs)` gives the local parameter back
    (needed to load a checkpoint), or is None.
    """

    local_name: str
    local_shape: tuple[int, ...]
    outputs: tuple[AffineMap, ...]
    dtypes: tuple[str, ...]
    forward: Callable[..., Sequence]
    inverse: Callable[..., object] | None = None
    kind: str = "residual"  # what it computes, for messages

    def __post_init__(self):
        if len(self.outputs) != len(self.dtypes):
            raise ValueError(f"{self.local_name}: {len(self.outputs)} outputs but {len(self.dtypes)} dtypes")

    @property
    def numel(self) -> int:
        return math.prod(int(s) for s in self.local_shape)

    @property
    def produces(self) -> bool:
        """Whether this position computes any canonical element (False: replica of another)."""
        return any(o.pieces for o in self.outputs)

    def produced_by(self, start: int, stop: int) -> bool:
        """Whether the rank owning local range [start, stop) computes this residual.

        The data-parallel replicas of one TP/PP position partition each parameter
        into owned ranges; exactly one of them contains local element 0, so exactly
        one rank per position recomputes the residual. Under the distributed optimizer
        parameters start in different DP ranks' shards, so residuals spread over them."""
        return start == 0 and stop > 0 and self.produces

    def key(self, i: int) -> str:
        """Baseline key of output i: the canonical slice it covers (stable across ranks)."""
        out = self.outputs[i]
        return "residual:" + ";".join(
            f"{p.canonical}[{p.offset}+{p.rows}x{p.cols}/{p.row_stride}]" for p in out.pieces)

    def compute(self, local) -> list:
        """forward(local), checked: one flat tensor per output, of the declared size."""
        outs = list(self.forward(local))
        if len(outs) != len(self.outputs):
            raise ValueError(f"{self.local_name}: {self.kind} returned {len(outs)} outputs, "
                             f"expected {len(self.outputs)}")
        flat = []
        for i, (t, o) in enumerate(zip(outs, self.outputs)):
            t = t.reshape(-1)
            if t.numel() != o.numel:
                raise ValueError(f"{self.local_name}: {self.kind} output {i} has {t.numel()} elements, "
                                 f"expected {o.numel}")
            flat.append(t)
        return flat


def places_anything(m: AffineMap | ResidualMap, start: int, stop: int) -> bool:
    """Whether the owned local range [start, stop) sends anything through `m`."""
    if isinstance(m, ResidualMap):
        return m.produced_by(start, stop)
    return any(p.local_start < stop and p.local_stop > start for p in m.pieces)


class PositionSlots:
    """Where a scan of one local range puts the canonical positions its pieces compute
    chunk after chunk (`Piece.canonical_index`): arrays handed out end to end in one growing
    buffer per slot (a piece), so that the payload builder takes consecutive chunks'
    positions as one view (`arena.end_to_end`), as it does the diff's own arrays
    (`diff.DiffOutput`, whose capacity sizes a new buffer: about the rest of the range's
    changes). A request that does not fit starts a new buffer; views handed out stay valid."""

    def __init__(self, sink: DiffOutput):
        self.sink = sink
        self.bufs: dict[int, tuple[np.ndarray, int]] = {}

    def take(self, slot: int, n: int, dtype) -> np.ndarray:
        buf, used = self.bufs.get(slot, (None, 0))
        if buf is None or buf.dtype != dtype or used + n > buf.size:
            room = self.sink.bufs[0].size if self.sink.bufs is not None else 0
            buf, used = np.empty(max(n, room), dtype), 0
        self.bufs[slot] = (buf, used + n)
        return buf[used:used + n]


def place_by_tensor(amap: AffineMap, local: np.ndarray) -> list[tuple[str, np.ndarray, slice | np.ndarray]]:
    """(canonical name, positions uint64, source index or slice) per touched canonical
    tensor. When every touched piece has its own tensor (the usual case) the sources are
    contiguous ranges of `local`, taken as slices (views), not gathered."""
    placed = amap.place(local)
    if len({name for name, _, _ in placed}) == len(placed):
        return [(name, cpos.view(np.uint64) if cpos.dtype == np.int64 else cpos.astype(np.uint64),
                 slice(int(src[0]), int(src[-1]) + 1)) for name, cpos, src in placed]
    return [(name, cpos, src) for name, (cpos, src) in merge_placed(placed).items()]


def merge_placed(placed: list[tuple[str, np.ndarray, np.ndarray]]):
    """Group placed pieces by canonical name: name -> (sorted positions, source index)."""
    groups: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for name, pos, src in placed:
        groups.setdefault(name, []).append((pos, src))
    merged = {}
    for name, parts in groups.items():
        pos = np.concatenate([p for p, _ in parts]) if len(parts) > 1 else parts[0][0]
        src = np.concatenate([s for _, s in parts]) if len(parts) > 1 else parts[0][1]
        if pos.size > 1 and not np.all(pos[1:] > pos[:-1]):
            order = np.argsort(pos, kind="stable")
            pos, src = pos[order], src[order]
        # Canonical positions are >= 0: an int64 array is reinterpreted, not copied.
        merged[name] = (pos.view(np.uint64) if pos.dtype == np.int64 else pos.astype(np.uint64, copy=False), src)
    return merged


def check_exact_cover(
    runs: dict[str, list[tuple[np.ndarray, np.ndarray, str]]], numels: dict[str, int]
) -> None:
    """Every canonical element owned exactly once.

    runs: canonical name -> list of (starts, lengths, owner description).
    Raises ConverterError naming the tensor, the first bad element and the owners.
    """
    from nemo_dcr.errors import ConverterError

    unknown = sorted(set(runs) - set(numels))
    if unknown:
        raise ConverterError(f"pieces target tensors that the checkpoint does not hold: {unknown[:5]}")
    for name, numel in numels.items():
        parts = runs.get(name, [])
        if not parts:
            raise ConverterError(f"canonical tensor {name!r} is owned by no rank")
        starts = np.concatenate([s for s, _, _ in parts])
        lengths = np.concatenate([n for _, n, _ in parts])
        owners = np.concatenate([np.full(len(s), i) for i, (s, _, _) in enumerate(parts)])
        order = np.argsort(starts, kind="stable")
        starts, lengths, owners = starts[order], lengths[order], owners[order]
        ends = starts + lengths
        if starts[0] != 0:
            raise ConverterError(f"{name!r}: elements [0, {starts[0]}) are owned by no rank")
        gaps = np.nonzero(starts[1:] != ends[:-1])[0]
        if gaps.size:
            i = gaps[0]
            if starts[i + 1] < ends[i]:
                a, b = parts[owners[i]][2], parts[owners[i + 1]][2]
                raise ConverterError(
                    f"{name!r}: element {starts[i + 1]} is owned twice ({a} and {b})"
                )
            raise ConverterError(f"{name!r}: elements [{ends[i]}, {starts[i + 1]}) are owned by no rank")
        if ends[-1] != numel:
            if ends[-1] > numel:
                raise ConverterError(f"{name!r}: pieces reach element {ends[-1]} beyond its {numel} elements")
            raise ConverterError(f"{name!r}: elements [{ends[-1]}, {numel}) are owned by no rank")
