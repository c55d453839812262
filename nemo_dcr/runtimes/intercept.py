"""Runtime-agnostic receiver engine: records applied by intercepting a native loader.

Why: the receiver must never decide where a canonical element lives in a serving
model. The runtime's own loader already knows (tensor-parallel narrowing, fused
splits, transposes); re-deriving that per model family would drift from it and
corrupt bits silently. So we run the loader on a *scratch* tensor of the canonical
shape and dtype, under a `TorchDispatchMode` that sees every aten op it runs:

* a `copy_` into parameter/buffer storage is *recorded, not executed*. If its source
  is the scratch or a view of it (same storage, same dtype), its geometry (size,
  stride, storage offset, after broadcasting) says exactly which canonical element
  lands on which destination element, whatever narrowing, slicing, splitting or
  transposing the loader did;
* any other write into model storage (fill_, index_put_, out=...) fails closed,
  unless it writes zero elements (it then runs: it changes nothing);
* a write into the scratch itself marks the tensor as value-transforming.

Nothing is written until the whole batch has been planned and validated. Then each
record is applied on the integer bit view of the destinations: `^=` for xor,
wrapping `+=` (same-width signed ints) for add, `where(mask, new, old)` for masked
overwrite, so any bit pattern (NaN payloads, -0.0) arrives intact. A single identity
copy (the usual HF case) is applied sparsely at the record's positions; anything
else goes through dense value/mask buffers viewed with the copy's geometry.

A loader that transforms values, casts, or writes overlapping regions cannot carry a
delta exactly: xor/add records fail closed (ApplyError, nothing written) and the
sender falls back to overwrite. An overwrite through such a loader hands it the whole
new tensor (current canonical bits with the record applied), lets it write the way a
dense refit would, verifies the result through the canonical tensor, and keeps the
raw old bits of the written regions to undo.

Limits: copies are traced by storage identity only through views of the scratch (a
`.clone()`/`.contiguous()` of a non-contiguous view counts as a transformation);
plans are kept while the model's storage and loaders stay the same (the loader runs
once per tensor, not once per apply), and overlap between two canonical tensors is
checked over every plan kept, so it is seen once both have been planned, in any calls;
a loader that replaces parameter storage (assign=True, swap_tensors) is refused.
Every storage `_destinations` names counts as model storage. A concrete adapter
(see `nemo_dcr.runtimes.hf`) supplies `_load`, `_destinations`, `catalog` and
`canonical_state`. An adapter that holds only part of some tensors (a tensor-parallel
shard: `nemo_dcr.runtimes.megatron.receiver`) sets `full_coverage = False` and names
its elements with `_held_mask`.
"""

from __future__ import annotations

import abc
import collections
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nemo_dcr import digest, dtypes, kernels
from nemo_dcr.errors import ApplyError
from nemo_dcr.records import Op, Record
from nemo_dcr.runtimes import scatter
from nemo_dcr.runtimes.base import Catalog, RuntimeAdapter, UndoLog, inverse
from nemo_dcr.runtimes.loader_trace import (CopyInterceptor, LoaderCopy, LoaderPlan, StorageView, mark_view,
                                            storage_key)
from nemo_dcr.wire.positions import check_positions, signed_view

_aten = torch.ops.aten
# numpy dtype with the same width as `DType.bits_torch` (torch lacks wide unsigned ops)
_NP_BITS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_NEVER_WROTE = "the runtime's loader never wrote this tensor (skipped)"
_SCATTER_OP = {Op.XOR: scatter.XOR, Op.ADD: scatter.ADD}


class _Inverse:
    """Undo step of an applied xor / add record: the record, inverted only if the step is
    ever used. Negating add values up front cost a pass over every change inside the
    pause, for an undo that rarely runs."""

    __slots__ = ("record",)

    def __init__(self, record: Record):
        self.record = record

    @property
    def name(self) -> str:
        return self.record.name

    def __len__(self) -> int:
        return len(self.record)


def _undo_record(step: Record | _Inverse) -> Record:
    return inverse(step.record) if isinstance(step, _Inverse) else step


def _scatter_arrays(bits: torch.Tensor, record: Record) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the compiled scatter takes for `record` on the contiguous CPU bit view `bits`:
    the storage's flat unsigned view and the record's own positions and values (no torch
    copies of either)."""
    flat = bits.view(-1).numpy().view(np.dtype(f"<u{bits.element_size()}"))
    return flat, signed_view(record.positions), np.asarray(record.values, dtype=flat.dtype)


def _torch_bits(values: np.ndarray, dtype: dtypes.DType) -> torch.Tensor:
    """Unsigned numpy bits -> the same-width torch integer view (`DType.bits_torch`)."""
    arr = np.ascontiguousarray(values, dtype=f"=u{dtype.itemsize}")
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr.view(_NP_BITS[dtype.itemsize]))


def _new_bits(op: Op, old: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The bits an xor / add record leaves where the runtime held `old` (unsigned, one width)."""
    values = np.asarray(values, dtype=old.dtype)
    return np.bitwise_xor(old, values) if op is Op.XOR else old + values  # unsigned: wraps mod 2**width


class _BadPositions(Exception):
    """The compiled scatter met a record's bad position; nothing of the record is applied."""


def _positions_problem(record: Record) -> str:
    pos = record.positions
    bad = "out of range" if pos.size and int(pos.max()) >= record.numel else "not strictly increasing"
    return f"positions {bad} (numel {record.numel})"


def _positions(record: Record, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(record.positions.astype(np.int64)).to(device)


def _held_bits(got: torch.Tensor, expected: torch.Tensor, held: torch.Tensor | None):
    """Bit views of `got` and `expected` (same dtype and shape), on the held elements only."""
    a, b = dtypes.bits_of(got), dtypes.bits_of(expected).to(got.device)
    if held is None:
        return a, b
    held = held.to(got.device)
    return a.reshape(-1)[held], b.reshape(-1)[held]


@dataclass
class RestoreBits:
    """Raw old bits of regions written by a dense overwrite, restored verbatim."""

    items: list[tuple[torch.Tensor, torch.Tensor]]

    def restore(self) -> None:
        for dst, old in reversed(self.items):
            dtypes.bits_of(dst.detach()).copy_(old)


class NativeLoaderAdapter(RuntimeAdapter, abc.ABC):
    """Applies records by intercepting a runtime's native loader (runtime-agnostic part).

    Subclasses say how to run the loader (`_load`), which storages belong to the model
    (`_destinations`), and, from `RuntimeAdapter`, the catalog and how to read a
    canonical tensor back (`canonical_state`).
    """

    full_coverage = True  # the loader must consume every element of a tensor it loads
    # Whether `apply` reports how it moved the whole-state digest (`UndoLog.digest`); off,
    # the logs carry None and the writes skip the digest's arithmetic.
    track_digest = True
    # Threads for the pause's compiled scatters (`nemo_dcr.runtimes.scatter`); None: the
    # cores this process may use, at most 8; 1: one thread, record after record.
    apply_threads: int | None = None
    _pool: scatter.ScatterPool | None = None
    _batch_layout: tuple | None = None  # while a `batch()` is open: the layout, checked once
    scratch_device: str | torch.device | None = None  # None: the tensor's own device

    # -- to implement -------------------------------------------------------------
    @abc.abstractmethod
    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Run the runtime's native loader on `tensors` (canonical name -> tensor).

        Called under interception: copies into model storage are recorded instead of
        executed, any other write into it raises. Must not rebind or replace model
        storage, and must not leave the model pointing at the given tensors.
        """

    @abc.abstractmethod
    def _destinations(self) -> dict[int, str]:
        """Storage identity (`storage_key`) -> a name, for every storage of the model.

        Everything listed here counts as model storage: only intercepted copies may
        write it. Compared before and after each load to catch replaced storage.
        """

    def _layout(self) -> tuple:
        """What kept plans depend on, compared by value: the model's storage and whatever
        decides what the loader does beyond it (load hooks, per-parameter loader functions
        a runtime lets change). Checked on every apply: adapters of module trees return
        `module_fingerprint`, which covers both cheaply."""
        return tuple(self._destinations())

    def _canonical_tensor(self, name: str) -> torch.Tensor:
        """The runtime's current tensor for canonical `name` (override to cache)."""
        return self.canonical_state()[name]

    # Whether `_canonical_tensor` is the live tensor in canonical layout, all of it (a
    # tensor store, a Hugging Face model): then conditioned records decode against it in place.
    canonical_layout = False

    def committed_bits(self, name: str, lo: int, hi: int) -> np.ndarray | None:
        if not self.canonical_layout or name not in self.catalog():
            return None
        flat = dtypes.bits_of(self._canonical_tensor(name).detach()).reshape(-1)
        return dtypes.host_bits(flat[lo:hi]) if 0 <= lo <= hi <= flat.numel() else None

    def _refresh(self) -> None:
        """Drop anything cached about the model's storage (before planning and undo)."""

    def _held_mask(self, name: str) -> torch.Tensor | None:
        """Flat bool mask of the canonical elements this runtime holds; None: all of them.

        A runtime holding only part of a tensor (a tensor-parallel shard, with
        `full_coverage = False`) returns a mask; `_canonical_tensor` may then hold
        anything outside it, and a dense overwrite is verified on the held elements only.
        """
        return None

    # -- contract -----------------------------------------------------------------
    def check(self, records: Sequence[Record]) -> None:
        self._prepare(list(records), applying=False)

    def apply(self, records: Sequence[Record]) -> UndoLog:
        records = list(records)
        plans = self._prepare(records, applying=True)
        log = UndoLog(digest=digest.StateDigest() if self.track_digest else None)
        try:
            pooled = self._pooled(records, plans)
            for i, record in enumerate(records):
                if not len(record) or i in pooled:  # an empty record changes nothing
                    continue
                try:
                    log.steps.append(self._execute(record, plans[record.name], log.digest))
                except _BadPositions as bad:  # found by the compiled scatter, its own changes taken back
                    raise ApplyError(f"record {i} ({record.name!r}): {bad}") from None
            if pooled:
                self._apply_pooled([(i, records[i], plans[records[i].name]) for i in sorted(pooled)], log)
        except BaseException as exc:
            try:
                self._undo(log.steps, plans)  # same geometry: no second loader run
            except Exception as undo_exc:
                raise ApplyError(
                    f"apply failed ({exc}) and reverting it failed too ({undo_exc}): "
                    "runtime bits are inconsistent, reload from an anchor checkpoint", bits_unknown=True
                ) from exc
            raise
        return log

    def revert(self, log: UndoLog) -> None:
        if log.reverted:
            raise ApplyError("this undo log was already reverted")
        self._undo(log.steps)
        log.reverted = True

    # -- validation and planning (writes nothing) ----------------------------------
    @contextlib.contextmanager
    def batch(self):
        # The refresh and the layout (a walk over every module, and a receiver applies one
        # payload per call, 16-27 a refit end to end), once a batch.
        self._refresh()
        self._batch_layout = self._layout()
        try:
            yield
        finally:
            self._batch_layout = None

    def _layout_checked(self) -> tuple:
        """`_layout()`: the batch's, or computed anew outside one."""
        return self._layout() if self._batch_layout is None else self._batch_layout

    def _refresh_outside_batch(self) -> None:
        """`_refresh()` unless a batch is open (nothing can have moved since it opened)."""
        if self._batch_layout is None:
            self._refresh()

    def _prepare(self, records: list[Record], *, applying: bool) -> dict[str, LoaderPlan]:
        """Check `records` and plan them; writes nothing. When `applying`, the positions of
        records that the compiled scatter will apply are left to it (`_scatters`)."""
        self._refresh_outside_batch()  # parameters may have moved or been replaced since the last call
        if torch.__future__.get_swap_module_params_on_conversion():
            raise ApplyError("torch swap_module_params_on_conversion is on: loads would replace storage")
        catalog = self.catalog()
        for i, record in enumerate(records):
            self._check_static(i, record, catalog)
        plans = self._plan({r.name for r in records if len(r)})
        for i, record in enumerate(records):
            plan = plans.get(record.name)
            if plan is not None and plan.irregular and Op(record.op) is not Op.OVERWRITE:
                raise ApplyError(
                    f"record {i} ({record.name!r}, {Op(record.op).value}): {plan.irregular}; "
                    "a delta cannot be applied exactly through this loader, send an overwrite"
                )
            # An overwrite reads its old bits first (through torch), so its positions are
            # checked here; an xor / add the scatter applies it checks as it writes.
            if not (applying and plan is not None and Op(record.op) is not Op.OVERWRITE and self._scatters(plan)):
                if len(record) and check_positions(record.positions, record.numel):  # one compiled pass
                    raise ApplyError(f"record {i} ({record.name!r}): {_positions_problem(record)}")
        return plans

    def _check_static(self, i: int, r: Record, catalog: Catalog) -> None:
        where = f"record {i} ({getattr(r, 'name', '?')!r})"
        if not isinstance(r, Record):
            raise ApplyError(f"{where}: not a Record")
        if r.name not in catalog:
            raise ApplyError(f"{where}: tensor {r.name!r} is not in the runtime's catalog")
        dtype_name, shape = catalog[r.name]
        if r.dtype != dtype_name:
            raise ApplyError(f"{where}: dtype {r.dtype} but {r.name} is {dtype_name}")
        if tuple(r.shape) != tuple(shape):
            raise ApplyError(f"{where}: shape {tuple(r.shape)} but {r.name} is {tuple(shape)}")
        try:
            Op(r.op)
        except ValueError:
            raise ApplyError(f"{where}: unknown operation {r.op!r}") from None
        pos, vals = r.positions, r.values
        if not isinstance(pos, np.ndarray) or pos.ndim != 1 or pos.dtype.kind != "u":
            raise ApplyError(f"{where}: positions must be a 1-D unsigned integer array")
        itemsize = dtypes.from_name(dtype_name).itemsize
        if (not isinstance(vals, np.ndarray) or vals.ndim != 1 or vals.dtype.kind != "u"
                or vals.dtype.itemsize != itemsize):
            raise ApplyError(f"{where}: values must be a 1-D array of <u{itemsize}")
        if pos.shape != vals.shape:
            raise ApplyError(f"{where}: {pos.shape[0]} positions but {vals.shape[0]} values")

    def _plan(self, names: set[str]) -> dict[str, LoaderPlan]:
        """Plans for `names`: run the loader once for those not planned yet (one at a time
        when copies are ambiguous).

        Plans are kept while the model's storage and loaders are the same (`_layout`, per
        scratch device): a loader's copy geometry is fixed for a model, and rerunning it on every
        apply cost most of a refit's pause. Overlap checks run over
        every plan kept, so two tensors writing one region are caught even when they
        arrive in different payloads."""
        if not names:
            return {}
        layout = (str(self.scratch_device), self._layout_checked())
        if getattr(self, "_plans_layout", None) != layout:
            self._plans: dict[str, LoaderPlan] = {}
            self._plans_layout = layout
        missing = sorted(names - self._plans.keys())
        if missing:
            plans = self._plan_batch(missing)
            if plans is None:
                plans = {}
                for name in missing:
                    plans.update(self._plan_batch([name]))
            self._plans.update(plans)
            self._mark_overlaps(self._plans)
        return {n: self._plans[n] for n in names}

    def _scratch(self, name: str) -> torch.Tensor:
        dtype_name, shape = self.catalog()[name]
        device = self.scratch_device
        if device is None:
            try:
                device = self._canonical_tensor(name).device
            except Exception:
                device = "cpu"
        return torch.empty(shape, dtype=dtypes.from_name(dtype_name).torch_dtype, device=device)

    def _intercepted_load(self, tensors: dict[str, torch.Tensor]) -> CopyInterceptor:
        label = ", ".join(sorted(tensors))
        destinations = self._destinations()
        mode = CopyInterceptor({storage_key(t): n for n, t in tensors.items()}, destinations)
        try:
            with mode:
                self._load(tensors)
        except Exception as exc:
            reason = mode.errors[0] if mode.errors else exc if isinstance(exc, ApplyError) else (
                f"the native loader failed: {exc}")
            raise ApplyError(f"{label}: {reason}") from exc
        if mode.errors:
            raise ApplyError(f"{label}: {mode.errors[0]}")
        if set(self._destinations()) != set(destinations):
            raise ApplyError(f"{label}: the loader replaced parameter storage; cannot apply in place")
        return mode

    def _plan_batch(self, names: list[str]) -> dict[str, LoaderPlan] | None:
        """Plans for `names` from one loader run; None if a batch cannot be attributed."""
        single = len(names) == 1
        catalog = self.catalog()
        scratch = {n: self._scratch(n) for n in names}
        by_key = {storage_key(t): n for n, t in scratch.items()}
        try:
            mode = self._intercepted_load(scratch)
        except ApplyError:
            if single:
                raise
            return None  # attribute the failure to one tensor
        plans = {n: LoaderPlan(n, dtypes.from_name(catalog[n][0]), tuple(catalog[n][1])) for n in names}
        for dst, src in mode.copies:
            where = mode.destinations.get(storage_key(dst), "?")
            name = by_key.get(storage_key(src))
            if name is None:
                if not single:
                    return None
                plan = plans[names[0]]
                plan.irregular = (f"the loader copies a transformed value (not a view of {plan.name}) "
                                  f"into {where}")
                plan.copies.append(LoaderCopy.into(dst, StorageView((), (), 0), where))
                continue
            plan = plans[name]
            if src.dtype != scratch[name].dtype or dst.dtype != src.dtype:
                plan.irregular = f"the loader casts {src.dtype} into {where} ({dst.dtype})"
            try:
                geometry = StorageView.of(src.expand(dst.shape))
            except RuntimeError:
                raise ApplyError(f"{name}: shape {tuple(src.shape)} cannot be copied into "
                                 f"{where} {tuple(dst.shape)}") from None
            plan.copies.append(LoaderCopy.into(dst, geometry, where))
        for name in mode.mutated:
            plans[name].irregular = f"the loader modifies the incoming {name} in place"
        self._mark_overlaps(plans)
        for plan in plans.values():
            self._finish(plan)
        return plans

    def _mark_overlaps(self, plans: dict[str, LoaderPlan]) -> None:
        """Copies writing one destination element twice would double-apply a delta."""
        by_storage: dict[int, list[tuple[LoaderCopy, LoaderPlan]]] = {}
        for plan in plans.values():
            for copy in plan.copies:
                if not copy.dst_view.distinct():
                    plan.irregular = f"the loader writes {copy.where} through an overlapping view"
                by_storage.setdefault(copy.dst_key, []).append((copy, plan))
        for entries in by_storage.values():
            if len(entries) < 2:
                continue
            entries.sort(key=lambda e: e[0].dst_view.span())  # sweep clusters of touching spans
            cluster, end = [entries[0]], entries[0][0].dst_view.span()[1]
            for entry in entries[1:] + [None]:
                lo, hi = entry[0].dst_view.span() if entry else (end, end)
                if entry is not None and lo < end:
                    cluster.append(entry)
                    end = max(end, hi)
                    continue
                if len(cluster) > 1:
                    self._check_cluster(cluster)
                if entry is not None:
                    cluster, end = [entry], hi

    @staticmethod
    def _check_cluster(cluster: list[tuple[LoaderCopy, LoaderPlan]]) -> None:
        sizes = {c.dst.element_size() for c, _ in cluster}
        base = min(c.dst_view.span()[0] for c, _ in cluster)
        top = max(c.dst_view.span()[1] for c, _ in cluster)
        marks = torch.zeros(top - base, dtype=torch.bool)
        overlap = len(sizes) > 1 or any([mark_view(marks, c.dst_view, base) for c, _ in cluster])
        if overlap:
            for copy, plan in cluster:
                plan.irregular = f"the loader writes overlapping regions of {copy.where}"

    def _finish(self, plan: LoaderPlan) -> None:
        if not plan.copies:
            raise ApplyError(f"{plan.name}: {_NEVER_WROTE}")
        if plan.irregular:
            return
        full = StorageView.of(torch.empty(plan.shape, device="meta"))  # contiguous geometry
        first = plan.copies[0]
        plan.identity = (
            len(plan.copies) == 1
            and first.src == full
            and first.dst_view.size == plan.shape
            and first.dst.is_contiguous()
        )
        if self.full_coverage and not plan.identity and not self._covered(plan):
            raise ApplyError(f"{plan.name}: the runtime's loader wrote only part of this tensor")

    @staticmethod
    def _covered(plan: LoaderPlan) -> bool:
        views = [c.src.deduplicated() for c in plan.copies]
        if all(v.dense() for v in views):
            reach = 0
            for lo, hi in sorted(v.span() for v in views):
                if lo > reach:
                    return False
                reach = max(reach, hi)
            return reach >= plan.numel
        marks = torch.zeros(plan.numel, dtype=torch.bool)
        for v in views:
            mark_view(marks, v, 0)
        return bool(marks.all())

    # -- writing -------------------------------------------------------------------
    def _wrote(self, plan: LoaderPlan, step) -> None:
        """Called once a record has been written (on the calling thread or by the scatter
        pool, applied or undone), with its undo step: a hook for adapters that follow up
        on what was written (vLLM re-runs its post-load processing for those layers)."""

    def _execute(self, record: Record, plan: LoaderPlan, state: digest.StateDigest | None = None):
        """Apply one record; return the step that undoes it. All or nothing. `state`: the
        digest delta the write is added to (none for an undo: the receiver takes a whole
        log's delta back)."""
        step = self._write_record(record, plan, state)
        self._wrote(plan, step)
        return step

    def _write_record(self, record: Record, plan: LoaderPlan, state: digest.StateDigest | None = None):
        """`_execute` on this thread, before the `_wrote` hook."""
        if plan.irregular:
            return self._dense_overwrite(record, plan, state)
        moved = None  # how the digest moves: from the old bits read here, or from the scatter
        if Op(record.op) is Op.OVERWRITE:
            old = self._old_bits(record, plan)
            undo = Record(record.name, record.dtype, record.shape, Op.OVERWRITE, record.positions, old)
            if state is not None:
                moved = digest.change_delta(record.name, Op.OVERWRITE, record.positions, record.values, old)
        else:
            undo = _Inverse(record)
            if state is not None and not self._scatters(plan):
                old = self._old_bits(record, plan)
                moved = digest.change_delta(record.name, Op.OVERWRITE, record.positions,
                                            _new_bits(Op(record.op), old, record.values), old)
        done: list[LoaderCopy] = []
        cache: dict = {}
        if state is not None and moved is None:
            cache["sums"] = np.zeros(2, np.uint64)  # the compiled scatter adds its writes' here
        try:
            for copy in plan.copies:
                self._write(plan, record, copy, cache)
                done.append(copy)
        except BaseException:
            cache.clear()  # each copy is one in-place kernel: undo only those that completed
            for copy in done:
                self._write(plan, _undo_record(undo), copy, cache)
            raise
        if state is not None:
            state.add(record.name, moved if moved is not None else cache["sums"])
        return undo

    def _pooled(self, records: list[Record], plans: dict[str, LoaderPlan]) -> set[int]:
        """Indices of the xor / add records the scatter pool applies side by side: those
        the compiled scatter takes, each the only record of its tensor in this call (so
        no two threads write one element). None of them with a single apply thread."""
        if scatter.resolve_threads(self.apply_threads) < 2:
            return set()
        names = collections.Counter(r.name for r in records)
        return {i for i, r in enumerate(records)
                if len(r) and Op(r.op) in _SCATTER_OP and names[r.name] == 1 and self._scatters(plans[r.name])}

    def _apply_pooled(self, work: list[tuple[int, Record, LoaderPlan]], log: UndoLog) -> None:
        """Scatter (index, record, plan) side by side; the applied ones join `log`."""
        jobs = [scatter.Job(*_scatter_arrays(dtypes.bits_of(plan.copies[0].dst.detach()), record),
                            _SCATTER_OP[Op(record.op)], digest.kernel_keys(record) if log.digest is not None else None)
                for _, record, plan in work]
        applied = self._scatter_pool().run(jobs)  # each job whole, or (bad positions) none of it
        for (_, record, plan), ok, job in zip(work, applied, jobs):
            if ok:
                log.steps.append(step := _Inverse(record))
                if log.digest is not None:
                    log.digest.add(record.name, job.sums)
                self._wrote(plan, step)
        bad = next(((i, record) for (i, record, _), ok in zip(work, applied) if not ok), None)
        if bad is not None:
            raise ApplyError(f"record {bad[0]} ({bad[1].name!r}): {_positions_problem(bad[1])}")

    def _scatter_pool(self) -> scatter.ScatterPool:
        threads = scatter.resolve_threads(self.apply_threads)
        if self._pool is None or self._pool.threads != threads:  # made once; again if apply_threads changed
            if self._pool is not None:
                self._pool.close()
            self._pool = scatter.ScatterPool(threads)
        return self._pool

    @staticmethod
    def _scatters(plan: LoaderPlan) -> bool:
        """Whether `_write` applies records of `plan` with the compiled scatter (which checks
        their positions as it writes): one plain copy into contiguous CPU storage."""
        return plan.identity and kernels.common.HAVE_NUMBA and plan.copies[0].dst.device.type == "cpu"

    def _write(self, plan: LoaderPlan, record: Record, copy: LoaderCopy, cache: dict) -> None:
        """Apply `record` to the destination elements of one copy, on the bit view."""
        op = Op(record.op)
        bits = dtypes.bits_of(copy.dst.detach())
        device = bits.device
        if self._scatters(plan):
            flat, pos, values = _scatter_arrays(bits, record)
            code = {Op.XOR: 0, Op.ADD: 1, Op.OVERWRITE: 2}[op]
            sums = cache.pop("sums", None)  # taken once: an undo of this record needs none
            if sums is not None:  # the digest's move summed as the scatter writes
                bad = digest.scatter_sums(flat, pos, values, code, *digest.kernel_keys(record), sums)
                cache["sums"] = sums
            else:
                bad = kernels.scatter.scatter_apply(flat, pos, values, code)
            if bad:
                if op is Op.OVERWRITE:  # its positions were checked before its old bits were read
                    raise ApplyError(f"{record.name}: {_positions_problem(record)} after the check",
                                     bits_unknown=True)
                done = bad - 1  # the changes before the first bad position were applied: take them back
                back = np.asarray(inverse(record).values[:done], dtype=flat.dtype)
                kernels.scatter.scatter_apply(flat, pos[:done], back, code)
                raise _BadPositions(_positions_problem(record))
            return
        if ("pos", device) not in cache:
            cache["pos", device] = _positions(record, device)
            cache["vals", device] = _torch_bits(record.values, plan.dtype).to(device)
        pos, vals = cache["pos", device], cache["vals", device]
        if plan.identity:  # sparse: touch only the record's positions
            flat = bits.view(-1)
            if op is Op.XOR:
                flat.index_put_((pos,), flat[pos] ^ vals)
            else:
                flat.index_put_((pos,), vals, accumulate=op is Op.ADD)
            return
        if ("dense", device) not in cache:  # materialised once per record and device
            values = torch.zeros(plan.numel, dtype=bits.dtype, device=device)
            values[pos] = vals
            mask = None
            if op is Op.OVERWRITE:
                mask = torch.zeros(plan.numel, dtype=torch.bool, device=device)
                mask[pos] = True
            cache["dense", device] = (values, mask)
        values, mask = cache["dense", device]
        g = copy.src
        v = values.as_strided(g.size, g.stride, g.offset)
        if op is Op.XOR:
            bits.bitwise_xor_(v)
        elif op is Op.ADD:
            bits.add_(v)  # wraps: mod 2**width on the same-width signed view
        else:
            bits.copy_(torch.where(mask.as_strided(g.size, g.stride, g.offset), v, bits))

    def _current(self, record: Record, plan: LoaderPlan, purpose: str) -> torch.Tensor:
        """The canonical tensor as the runtime holds it, checked against the catalog."""
        current = self._canonical_tensor(record.name).detach()
        if current.dtype != plan.dtype.torch_dtype or tuple(current.shape) != plan.shape:
            raise ApplyError(f"{record.name}: cannot read the canonical tensor back {purpose}: the "
                             f"runtime holds {current.dtype} {tuple(current.shape)}, not the "
                             f"canonical {plan.dtype.name} {plan.shape}")
        return current

    def _old_bits(self, record: Record, plan: LoaderPlan) -> np.ndarray:
        bits = dtypes.bits_of(self._current(record, plan, "to keep its old bits"))
        pos = _positions(record, bits.device)
        if bits.is_contiguous():
            old = bits.view(-1)[pos]
        else:
            old = bits[torch.unravel_index(pos, plan.shape)]
        return old.cpu().numpy().view(plan.dtype.bits_numpy).copy()

    def _dense_overwrite(self, record: Record, plan: LoaderPlan, state: digest.StateDigest | None = None) -> RestoreBits:
        """Overwrite through a loader that transforms/casts/overlaps: dense, then verified."""
        current = self._current(record, plan, "to overwrite it densely")
        target = current.clone(memory_format=torch.contiguous_format)
        pos = _positions(record, target.device)
        if state is not None:
            old = dtypes.bits_of(target).view(-1)[pos].cpu().numpy().view(plan.dtype.bits_numpy)
            moved = digest.change_delta(record.name, Op.OVERWRITE, record.positions, record.values, old)
        dtypes.bits_of(target).view(-1)[pos] = _torch_bits(record.values, plan.dtype).to(target.device)
        expected = target.clone()  # the loader may modify what it is handed
        mode = self._intercepted_load({record.name: target})
        if not mode.copies:
            raise ApplyError(f"{record.name}: {_NEVER_WROTE}")
        restore = RestoreBits([])
        try:
            for dst, src in mode.copies:  # replay in the loader's order, as a dense load would
                restore.items.append((dst, dtypes.bits_of(dst.detach()).clone()))
                with torch.no_grad():
                    dst.detach().copy_(src)
            got = self._canonical_tensor(record.name).detach()
            held = self._held_mask(record.name)
            if got.dtype != expected.dtype or got.shape != expected.shape or not torch.equal(
                *_held_bits(got, expected, held)
            ):
                raise ApplyError(
                    f"{record.name}: {plan.irregular}, and a dense overwrite through it does not "
                    "reproduce the canonical bits"
                )
        except BaseException:
            restore.restore()
            raise
        if state is not None:
            state.add(record.name, moved)
        return restore

    def _undo(self, steps: list, plans: dict[str, LoaderPlan] | None = None) -> None:
        self._refresh_outside_batch()
        if plans is None:
            plans = self._plan({s.name for s in steps if isinstance(s, (Record, _Inverse)) and len(s)})
        for step in reversed(steps):
            if isinstance(step, RestoreBits):
                step.restore()
            elif len(step):
                self._execute(_undo_record(step), plans[step.name])
