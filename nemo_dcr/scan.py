"""The producer's scanners: diff one owned range (or residual output) against its committed
bits chunk by chunk, stage each chunk's changes in the baseline, place them in canonical
coordinates and queue them in the payload builder. One scanner per path:

- `scan_compiled`: CPU bit views with numba. One compiled pass per chunk gives the
  positions, the new bits and the values to send (for 16-bit chunks inside one piece,
  canonical positions: no placement pass over the changes); no torch op, no extra pass.
- `scan_torch`: any other tensor; torch diffs, the changes are placed on the host.
- `scan_on_device`: format v6's device coding; torch diffs, and the changes are placed
  and kept where the tensor is (`Producer(device_coding=...)`).

Each yields a `ScannedChunk` after every chunk with changes, so that the producer cuts
and sends payloads between chunks (`scanner_for` picks the path)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from nemo_dcr import kernels
from nemo_dcr.baseline import Baseline
from nemo_dcr.diff import Delta, DiffCoordinates, DiffOutput, diff, diff_arrays
from nemo_dcr.digest import StateDigestMove
from nemo_dcr.dtypes import host_bits, unsigned_view
from nemo_dcr.payload_builder import AutoValues, CommittedSpan, PayloadBuilder
from nemo_dcr.placement import AffineMap, PositionSlots, merge_placed
from nemo_dcr.records import AUTO, Op


@dataclass
class ScanTarget:
    """Where one refit's scans put what they find: changes staged in the `baseline`, placed
    into the payload `builder`, and their move of the state digest; seconds into `times`
    ("diff", "place")."""

    baseline: Baseline
    builder: PayloadBuilder
    digest: StateDigestMove
    times: dict[str, float]
    conditioned: bool = False  # keep each chunk's committed bits beside its changes (CommittedSpan)


class ScannedChunk(NamedTuple):
    changed: int  # elements that changed in the chunk
    placed: int  # canonical elements they were placed at (a replica's changes are placed nowhere)


class HostChanges(NamedTuple):
    """One chunk's changes on the host, as the payload builder and the state digest take them."""

    positions: np.ndarray  # int32 / int64: range-relative (from the chunk's start), or canonical
    new: np.ndarray  # the new bits (unsigned)
    values: np.ndarray | AutoValues  # what the records carry for the operation
    digest_op: Op  # the values that tell the old bits (for the state digest): add or xor ...
    digest_values: np.ndarray  # ... or, for the others, the values themselves


class StagedChunk(NamedTuple):
    """A chunk's changes from the torch diff, already staged in the baseline."""

    delta: Delta
    positions: torch.Tensor  # range-relative, where the diff ran
    positions_host: torch.Tensor
    new_host: torch.Tensor
    started: float  # time.perf_counter() when its diff began


# diff_arrays values per operation: what the records carry (overwrite: the new bits)
# op "auto": the add values (what the choice keeps in practice: +-1 ULP steps and AdamW
# deltas alike) and the new bits, from which the rarer xor records are computed.
# overwrite: the xor too, for the state digest (old = new ^ xor; the record carries the new bits)
_DIFF_VALUES = {Op.XOR: ("xor",), Op.ADD: ("add",), Op.OVERWRITE: ("xor",), AUTO: ("add",)}
# Elements per diff chunk on a GPU: each chunk costs a few synchronising copies (nonzero,
# then the changes to the host), so chunks are larger there; a chunk's mask is one byte
# per element, small beside the weights.
_DEVICE_CHUNK = 1 << 26
_NP_BITS = (torch.int8, torch.uint8, torch.int16, torch.int32)
_UNSIGNED = {np.dtype(np.int64): np.uint64, np.dtype(np.int32): np.uint32}  # canonical_index gives these two


def scanner_for(current: torch.Tensor, committed: torch.Tensor, on_device: bool):
    """The scanner for the bit view `current` of a range whose committed bits are
    `committed`: its changes kept on its device (`on_device`), else the compiled host
    path where it applies, else torch's."""
    if on_device:
        return scan_on_device
    return scan_compiled if _compiled_diff(current, committed) else scan_torch


def chunk_step(current: torch.Tensor, chunk: int) -> int:
    """Elements per diff chunk of `current`: `chunk` on the CPU, larger on a GPU."""
    return chunk if current.device.type == "cpu" else max(chunk, _DEVICE_CHUNK)


def scan_compiled(target: ScanTarget, key: str, current: torch.Tensor, amap: AffineMap, offset: int,
                  op: Op | str, step: int) -> Iterator[ScannedChunk]:
    """Diff `current` against the committed bits under `key` with the compiled kernels,
    place the changes through `amap` (local index = offset + position) and queue them."""
    committed = target.baseline.committed(key)
    cur, com = current.detach().reshape(-1).numpy(), committed.detach().reshape(-1).numpy()
    sink = DiffOutput(current.numel())  # the chunks' changes end to end: records take them uncopied
    slots = PositionSlots(sink)  # and so the positions placed through strided pieces
    for lo in range(0, current.numel(), step):
        hi = min(lo + step, current.numel())
        t = time.perf_counter()
        # A 16-bit chunk inside one piece whose block rows end on diff blocks: the diff
        # writes canonical positions (no placement pass over the changes), and the
        # baseline maps them back to the range's at the commit.
        placed = amap.diff_placement(offset + lo, offset + hi) if cur.itemsize == 2 else None
        base, rows = (lo, None) if placed is None else placed[1:]
        positions, new_bits, vals = diff_arrays(cur[lo:hi], com[lo:hi], _DIFF_VALUES[op], base=base,
                                                narrow=True, out=sink, rows=rows)
        if positions.size == 0:
            target.times["diff"] += time.perf_counter() - t
            continue
        canonical = rows is not None or base != lo  # the positions are not the range's own
        target.baseline.stage(key, torch.from_numpy(positions), torch.from_numpy(new_bits),
                              coordinates=DiffCoordinates(lo, base, rows) if canonical else None)
        changes = _host_changes(op, positions, unsigned_view(new_bits), unsigned_view(vals[0]))
        # Conditioned coding: a chunk whose diff gave canonical positions by one shift sits
        # on one canonical span, whose committed bits are com[lo:hi].
        span = (CommittedSpan(com, lo, hi, base) if target.conditioned and placed is not None and rows is None
                and op in (AUTO, Op.XOR, Op.ADD) else None)
        yield _place_host(target, amap, offset, op, changes, slots, None if placed is None else placed[0], t, span)


def scan_torch(target: ScanTarget, key: str, current: torch.Tensor, amap: AffineMap, offset: int,
               op: Op | str, step: int) -> Iterator[ScannedChunk]:
    """`scan_compiled` through torch's diff (any device, any width), placed on the host."""
    for chunk in _diff_and_stage(target, key, current, step):
        diffed = chunk.delta.add() if _DIFF_VALUES[op] == ("add",) else chunk.delta.xor()
        changes = _host_changes(op, chunk.positions_host.numpy(), unsigned_view(chunk.new_host.numpy()),
                                host_bits(diffed))
        yield _place_host(target, amap, offset, op, changes, None, None, chunk.started)


def scan_on_device(target: ScanTarget, key: str, current: torch.Tensor, amap: AffineMap, offset: int,
                   op: Op | str, step: int) -> Iterator[ScannedChunk]:
    """`scan_torch` with the changes placed and queued as tensors where they are (format v6)."""
    for chunk in _diff_and_stage(target, key, current, step):
        t = time.perf_counter()
        target.times["diff"] += t - chunk.started
        placed = _place_on_device(target, amap, chunk.positions, offset, op, chunk.delta)
        target.times["place"] += time.perf_counter() - t
        yield ScannedChunk(len(chunk.positions), placed)


def _diff_and_stage(target: ScanTarget, key: str, current: torch.Tensor, step: int) -> Iterator[StagedChunk]:
    """torch's diff of `current` against the committed bits where it is (the host copy, or a
    GPU mirror), chunk by chunk; each chunk with changes staged in the baseline."""
    committed = target.baseline.committed_on(key, current.device)
    for lo in range(0, current.numel(), step):
        hi = min(lo + step, current.numel())
        t = time.perf_counter()
        delta = diff(current[lo:hi], committed[lo:hi])
        if len(delta) == 0:
            target.times["diff"] += time.perf_counter() - t
            continue
        positions = delta.positions + lo if lo else delta.positions
        positions_host, new_host = positions.cpu(), delta.new.cpu()  # to the host once each
        target.baseline.stage(key, positions_host, new_host, on_device=(positions, delta.new))
        yield StagedChunk(delta, positions, positions_host, new_host, t)


def _host_changes(op: Op | str, positions: np.ndarray, new: np.ndarray, diffed: np.ndarray) -> HostChanges:
    """A chunk's changes for `op`, from the values the diff gave for it (`_DIFF_VALUES`)."""
    if op == AUTO:
        return HostChanges(positions, new, AutoValues(diffed, new), Op.ADD, diffed)
    if op == Op.OVERWRITE:
        return HostChanges(positions, new, new, Op.XOR, diffed)
    return HostChanges(positions, new, diffed, op, diffed)


def _place_host(target: ScanTarget, amap: AffineMap, offset: int, op: Op | str, changes: HostChanges,
                slots: PositionSlots | None, canonical_name: str | None, started: float,
                span: CommittedSpan | None = None) -> ScannedChunk:
    """Place a chunk's changes through `amap` into the builder (`canonical_name`: the diff
    gave canonical positions of that tensor already) and the state digest's move."""
    t = time.perf_counter()
    target.times["diff"] += t - started
    positions = changes.positions
    if canonical_name is None:
        spans = _placed_spans(amap, positions, offset, slots)
    else:
        spans = [(canonical_name, positions.view(_UNSIGNED[positions.dtype]), slice(None), True)]
    keep_new = target.builder.track_new
    placed = 0
    for name, cpos, src, increasing in spans:
        values = AutoValues(changes.values.add[src], changes.values.new[src]) if op == AUTO else changes.values[src]
        target.builder.add(name, op, cpos, values, changes.new[src] if keep_new else None, increasing, span)
        target.digest.account(name, changes.digest_op, cpos, changes.new[src], changes.digest_values[src])
        placed += cpos.size
    target.times["place"] += time.perf_counter() - t
    return ScannedChunk(positions.size, placed)


def _place_on_device(target: ScanTarget, amap: AffineMap, positions: torch.Tensor, offset: int,
                    op: Op | str, delta: Delta) -> int:
    """Place a chunk's changes (`diff.Delta`, positions range-relative + chunk start, on
    their device) through `amap` (local index = offset + position) into the builder as
    tensors, values and all, where they are, and into the state digest's move (computed
    there too). Returns the elements placed."""
    if op == AUTO:
        values = AutoValues(delta.add(), delta.new)
    else:
        values = {Op.XOR: delta.xor, Op.ADD: delta.add, Op.OVERWRITE: lambda: delta.new}[op]()
    # what tells the old bits, for the state digest: the add, or the xor
    dop, dvals = (Op.ADD, values.add) if op == AUTO else (Op.XOR, delta.xor()) if op == Op.OVERWRITE else (op, values)
    new = delta.new if target.builder.track_new else None
    groups: dict[str, list] = {}
    for name, cpos, lo, hi, increasing in amap.place_spans(positions, offset):
        groups.setdefault(name, []).append((cpos, lo, hi, increasing))
    placed = 0
    for name, pieces in groups.items():
        if len(pieces) == 1:  # the usual case: one piece of this tensor, a contiguous slice
            cpos, lo, hi, increasing = pieces[0]
            src = slice(lo, hi)
        else:  # several pieces of one canonical tensor: merged in canonical order
            cpos = torch.cat([c for c, _, _, _ in pieces])
            src = torch.cat([torch.arange(lo, hi, device=cpos.device) for _, lo, hi, _ in pieces])
            order = torch.argsort(cpos, stable=True)
            cpos, src, increasing = cpos[order], src[order], True
        vals = AutoValues(values.add[src], values.new[src]) if op == AUTO else values[src]
        target.builder.add(name, op, cpos, vals, None if new is None else new[src], increasing)
        target.digest.account(name, dop, cpos, delta.new[src], dvals[src])
        placed += len(cpos)
    return placed


def _placed_spans(amap: AffineMap, positions: np.ndarray, offset: int, slots: PositionSlots | None = None):
    """`placement.place_by_tensor` of local positions `positions + offset` (sorted int64 or
    int32), with a fourth field: whether the canonical positions are known strictly
    increasing. Every touched piece with its own tensor (the usual case) takes a contiguous
    range of `positions`, returned as a slice; the offset is folded into the pieces, not
    added to a copy. `slots`: where computed canonical positions go, piece by piece."""
    spans = amap.place_spans(positions, offset, slots)
    if len({name for name, *_ in spans}) == len(spans):
        # int32 positions stay 32-bit (as uint32): see PayloadBatch.records
        return [(name, cpos.view(_UNSIGNED[cpos.dtype]), slice(lo, hi), increasing)
                for name, cpos, lo, hi, increasing in spans]
    placed = [(name, cpos, np.arange(lo, hi)) for name, cpos, lo, hi, _ in spans]
    return [(name, cpos, src, True) for name, (cpos, src) in merge_placed(placed).items()]


def _compiled_diff(current: torch.Tensor, committed: torch.Tensor) -> bool:
    """Whether `diff_arrays` (compiled) can diff these bit views directly."""
    return (kernels.common.HAVE_NUMBA and current.device.type == "cpu" and committed.device.type == "cpu"
            and current.dtype == committed.dtype and current.dtype in _NP_BITS
            and current.shape == committed.shape and current.is_contiguous() and committed.is_contiguous())
