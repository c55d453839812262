"""Megatron-inference receiver: canonical records applied in place into a Megatron
`GPTModel` whose TP/PP layout need not be the trainer's.

The native loader is the converter's loading plan: `converter.plan(local, layout,
specs, loading=True)` run by `load_into`, the same code that loads the version-0
checkpoint into this model. So where a canonical element lands (which TP shard,
which rows of a fused `linear_qkv` / `linear_fc1`, the last stage's tied copy of the
embedding) is decided once, by the converter's table, for loading and for refits
alike. `MegatronRuntime` drives that loader under the runtime-agnostic interception
engine (`nemo_dcr.runtimes.intercept`), which turns each block copy into an in-place
xor / add / masked overwrite on the shard's bit view.

One receiver per inference rank (per TP/PP rank of the inference model):

* Its catalog lists only the canonical tensors it holds some part of (`held`); the
  whole canonical catalog stays available as `canonical_catalog`, so a `Receiver`
  built with `canonical_catalog=runtime.canonical_catalog` validates every record
  against the checkpoint (unknown names are still rejected) and skips the records of
  tensors this rank does not hold.
* A TP shard holds part of a tensor (`full_coverage = False`): positions outside its
  part are dropped by the loader's geometry, nothing is written there and nothing
  fails; each element it does hold is written exactly once per destination (the
  engine refuses overlapping destinations). Replicated tensors (norms) are held whole
  by every TP rank, a tied output layer on the last PP stage holds its vocab shard of
  the embedding: each copy gets the same record.
* Vocab padding rows belong to no canonical tensor: `load_into` zeroes them at the
  initial load (`load_checkpoint`, not intercepted); refits reload only the recorded
  tensors (`load_into(..., names=...)`) and never write padding, so the interceptor's
  rule that only intercepted copies may write model storage is untouched.
* A residual rule (fused QKV declared as a residual, value transforms such as
  zero-centred norms) loads through its `inverse`: a transformed value, so xor / add
  records fail closed (ApplyError) and overwrites go through the engine's verified
  dense overwrite, which reads the rule's other targets from the current model.

Verification. A rank cannot return whole tensors it holds only in part, so
`canonical_state()` lists the tensors this rank holds whole (every element; replicated
norms, and everything when TP = 1), assembled in canonical layout; a receiver's
`verify` reply therefore carries digests of those. `slice_digests()` covers the rest:
one BLAKE2b-128 digest per held canonical block (a strided slice, named in the key),
to be compared with the same slices of a dense export (`expected_slice_digests`,
`compare_slice_digests`). The end-to-end check of an inference job is a dense export
of the whole inference model (tests use `tests/support/reference_export.py`, which
gathers any Megatron layout) compared digest for digest with the trainer's export.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from nemo_dcr import dtypes
from nemo_dcr.converter import Converter
from nemo_dcr.errors import ApplyError
from nemo_dcr.layout import LocalParam, ParallelLayout
from nemo_dcr.placement import Piece, ResidualMap
from nemo_dcr.runtimes.base import Catalog
from nemo_dcr.runtimes.intercept import NativeLoaderAdapter
from nemo_dcr.runtimes.loader_trace import storage_key
from nemo_dcr.runtimes.megatron.load import load_into
from nemo_dcr.runtimes.megatron.model import megatron_param_name_map
from nemo_dcr.verify import tensor_digest

_SLICE = re.compile(r"^(?P<name>.+)\[(?P<offset>\d+)\+(?P<rows>\d+)x(?P<cols>\d+)/(?P<stride>\d+)\]( <- .*)?$")


def slice_key(canonical: str, p: Piece, source: str) -> str:
    """`<canonical>[<offset>+<rows>x<cols>/<row stride>] <- <local parameter>`."""
    return f"{canonical}[{p.offset}+{p.rows}x{p.cols}/{p.row_stride}] <- {source}"


def _block(flat: torch.Tensor, offset: int, rows: int, cols: int, stride: int) -> torch.Tensor:
    return flat.as_strided((rows, cols), (stride, 1), flat.storage_offset() + offset)


def parallel_layout() -> ParallelLayout:
    """This rank's coordinates from `megatron.core.parallel_state` (inference: no DP)."""
    from megatron.core import parallel_state as ps

    return ParallelLayout(tp_size=ps.get_tensor_model_parallel_world_size(),
                          tp_rank=ps.get_tensor_model_parallel_rank(),
                          pp_size=ps.get_pipeline_model_parallel_world_size(),
                          pp_rank=ps.get_pipeline_model_parallel_rank(),
                          ep_size=ps.get_expert_model_parallel_world_size(),
                          ep_rank=ps.get_expert_model_parallel_rank(),
                          etp_size=ps.get_expert_tensor_parallel_world_size(),
                          etp_rank=ps.get_expert_tensor_parallel_rank())


class MegatronRuntime(NativeLoaderAdapter):
    """One inference rank's Megatron model chunks, written through the loading plan.

    model_chunks: this rank's GPTModel chunk(s) (wrappers holding `.module` are fine).
    converter: the family's converter (the trainer's table, same options).
    specs: the canonical checkpoint's catalog (`nemo_dcr.checkpoint.read_specs`).
    layout: this rank's TP/PP coordinates; default: from megatron's parallel_state.
    """

    full_coverage = False  # a TP shard holds part of a tensor: see _held_mask

    def __init__(self, model_chunks, converter: Converter, specs: Mapping[str, tuple],
                 layout: ParallelLayout | None = None, *, scratch_device: str | torch.device | None = None):
        self.chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
        self.layout = layout if layout is not None else parallel_layout()
        self.params = megatron_param_name_map(self.chunks)
        if not self.params:
            raise ApplyError("the Megatron model chunks hold no parameters")
        self.specs: Catalog = {n: (d, tuple(int(x) for x in s)) for n, (d, s) in specs.items()}
        local = [LocalParam(n, tuple(p.shape), p.dtype) for n, p in self.params.items()]
        self.maps = converter.plan(local, self.layout, self.specs, loading=True)
        # canonical name -> [(local parameter, residual output index or None, piece)]
        self._places: dict[str, list[tuple[str, int | None, Piece]]] = {}
        self._reads: dict[str, frozenset[str]] = {}  # local parameter -> canonical tensors it holds
        for pname, m in self.maps.items():
            if isinstance(m, ResidualMap):
                found = [(i, p) for i, o in enumerate(m.outputs) for p in o.pieces]
            else:
                found = [(None, p) for p in m.pieces]
            for i, p in found:
                self._places.setdefault(p.canonical, []).append((pname, i, p))
            self._reads[pname] = frozenset(p.canonical for _, p in found)
        self.held = frozenset(self._places)
        self._catalog: Catalog = {n: self.specs[n] for n in sorted(self.held)}
        self.whole = frozenset(n for n in self.held  # held entirely by this rank
                               if _covered(p for _, _, p in self._places[n]) == _numel(self.specs[n][1]))
        first = next(iter(self.params.values()))
        self.scratch_device = scratch_device if scratch_device is not None else first.device

    # -- loading -------------------------------------------------------------------
    def load_checkpoint(self, read) -> None:
        """The initial load (not intercepted): every local parameter from canonical
        tensors, `read(name)` returning one; vocab padding is zeroed."""
        load_into(self.params, self.maps, read)

    # -- catalog and verification ------------------------------------------------------
    def catalog(self) -> Catalog:
        """The canonical tensors this rank holds some part of."""
        return dict(self._catalog)

    @property
    def canonical_catalog(self) -> Catalog:
        """Every canonical tensor of the checkpoint (pass to `Receiver(canonical_catalog=...)`)."""
        return dict(self.specs)

    def canonical_state(self) -> dict[str, torch.Tensor]:
        """Tensors this rank holds whole, in canonical layout: a view of the parameter
        where one contiguous block is the whole tensor, else an assembled copy.

        Tensors held only in part are left out: see `held_slices` / `slice_digests`."""
        return {n: self._assemble(n) for n in sorted(self.whole)}

    def held_slices(self) -> dict[str, torch.Tensor]:
        """Every canonical block this rank holds, as it holds it: `slice_key` -> a
        (rows, cols) copy in the canonical dtype (a tied copy is listed separately)."""
        return {k: v.clone() for k, v in self._blocks()}

    def slice_digests(self) -> dict[str, str]:
        """BLAKE2b-128 of each held canonical block's bits, by `slice_key`."""
        return {k: tensor_digest(v) for k, v in self._blocks()}

    def _blocks(self):
        for name in sorted(self.held):
            cache: dict = {}
            for pname, i, p in self._places[name]:
                src = self._local_flat(pname, i, cache)
                yield slice_key(name, p, pname), src[p.local_start:p.local_stop].view(p.rows, p.cols)

    # -- NativeLoaderAdapter -------------------------------------------------------
    def _destinations(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for chunk in self.chunks:
            for name, t in list(chunk.named_parameters(remove_duplicate=False)) + list(
                chunk.named_buffers(remove_duplicate=False)
            ):
                if t is not None:
                    out.setdefault(storage_key(t), name)
        return out

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        names = frozenset(tensors)
        params = {p: t for p, t in self.params.items() if self._reads[p] & names}

        def read(name: str) -> torch.Tensor:
            t = tensors.get(name)
            return t if t is not None else self._canonical_tensor(name)  # a residual's other targets

        load_into(params, self.maps, read, names=names)

    def _canonical_tensor(self, name: str) -> torch.Tensor:
        if name not in self.held:
            raise ApplyError(f"{name}: this rank holds no part of it")
        return self._assemble(name)

    def _held_mask(self, name: str) -> torch.Tensor | None:
        if name in self.whole:
            return None
        mask = torch.zeros(_numel(self.specs[name][1]), dtype=torch.bool)  # built on demand, not kept
        for _, _, p in self._places.get(name, ()):
            _block(mask, p.offset, p.rows, p.cols, p.row_stride).fill_(True)
        return mask

    # -- helpers -------------------------------------------------------------------

    def _local_flat(self, pname: str, output: int | None, cache: dict) -> torch.Tensor:
        """The flat local values a piece indexes: the parameter, or a residual's output."""
        param = self.params[pname].detach()
        if output is None:
            return param.reshape(-1)
        if pname not in cache:
            cache[pname] = self.maps[pname].compute(param)
        return cache[pname][output]

    def _assemble(self, name: str) -> torch.Tensor:
        """The canonical tensor as this rank holds it, zero where it holds nothing: a view
        of the parameter when one contiguous block of it is the whole tensor, else a copy."""
        dtype_name, shape = self.specs[name]
        places = self._places[name]
        if len(places) == 1 and places[0][1] is None:
            pname, _, p = places[0]
            param = self.params[pname].detach()
            if (param.is_contiguous() and p.offset == 0 and p.size == _numel(shape)
                    and (p.rows == 1 or p.row_stride == p.cols)):
                return param.view(-1)[p.local_start:p.local_stop].view(shape)
        out = torch.zeros(_numel(shape), dtype=dtypes.from_name(dtype_name).torch_dtype, device=self.scratch_device)
        cache: dict = {}
        for pname, i, p in self._places[name]:
            src = self._local_flat(pname, i, cache)
            _block(out, p.offset, p.rows, p.cols, p.row_stride).copy_(
                src[p.local_start:p.local_stop].view(p.rows, p.cols))
        return out.view(shape)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _covered(pieces: Iterable[Piece]) -> int:
    """Canonical elements the pieces cover (overlaps counted once), from their row runs."""
    runs = [p.canonical_runs(p.local_start, p.local_stop) for p in pieces]
    if not runs:
        return 0
    starts = np.concatenate([s for s, _ in runs])
    stops = starts + np.concatenate([n for _, n in runs])
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], np.maximum.accumulate(stops[order])
    gaps = np.maximum(starts[1:] - stops[:-1], 0).sum() if starts.size > 1 else 0
    return int(stops[-1] - starts[0] - gaps)


def expected_slice_digests(dense: Mapping[str, torch.Tensor], keys: Iterable[str]) -> dict[str, str | None]:
    """Digests of the canonical blocks named by `keys` (`slice_key`s), cut from a dense
    canonical state (e.g. the trainer's export); None where a key names a tensor the
    state lacks or a block past its end."""
    out: dict[str, str | None] = {}
    for key in keys:
        m = _SLICE.match(key)
        t = dense.get(m["name"]) if m else None
        if t is None:
            out[key] = None
            continue
        offset, rows, cols, stride = (int(m[k]) for k in ("offset", "rows", "cols", "stride"))
        flat = t.detach().contiguous().reshape(-1)
        if rows and offset + (rows - 1) * stride + cols > flat.numel():
            out[key] = None
            continue
        out[key] = tensor_digest(_block(flat, offset, rows, cols, stride))
    return out


def compare_slice_digests(dense: Mapping[str, torch.Tensor], got: Mapping[str, str]) -> list[str]:
    """Keys of `got` (a rank's `slice_digests`) whose bits differ from `dense` (empty: exact)."""
    want = expected_slice_digests(dense, got)
    return sorted(k for k, d in got.items() if want[k] is None or want[k] != d)


def held_coverage(specs: Mapping[str, tuple], keys: Iterable[str]) -> dict[str, int]:
    """Canonical elements no key covers, per tensor (empty: the keys of all ranks
    together cover the checkpoint), for checking that an inference job holds everything."""
    marks = {n: torch.zeros(_numel(s), dtype=torch.bool) for n, (_, s) in specs.items()}
    for key in keys:
        m = _SLICE.match(key)
        if m and m["name"] in marks:
            offset, rows, cols, stride = (int(m[k]) for k in ("offset", "rows", "cols", "stride"))
            _block(marks[m["name"]], offset, rows, cols, stride).fill_(True)
    return {n: int((~v).sum()) for n, v in marks.items() if not bool(v.all())}


__all__ = ["MegatronRuntime", "parallel_layout", "slice_key", "expected_slice_digests", "compare_slice_digests",
           "held_coverage"]
