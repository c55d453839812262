"""Hugging Face transformers receiver: records applied through the model's own loaders.

`HFRuntime` is the Hugging Face half of the receiver: it runs `load_state_dict` as the
native loader, names every parameter and buffer as model storage, and builds the
catalog from the version-0 checkpoint's safetensors headers (`nemo_dcr.checkpoint.
read_specs`) or the model's state_dict, listing tied aliases once. Interception,
planning, application and undo are the runtime-agnostic engine in
`nemo_dcr.runtimes.intercept`.

Checkpoint names the model does not hold under that name (transformers 5 fuses the
per-expert tensors of MoE checkpoints into `mlp.experts.gate_up_proj` / `down_proj`,
and renames some prefixes) are resolved through transformers' own *save* path,
`revert_weight_conversion`: it turns the model's tensors back into checkpoint tensors
with pure data movement (chunk, unbind, rename). Running it on integer tags instead of
weights tells, element by element, where each checkpoint element lives in the model;
when that is one strided region of one model tensor the name is loaded and applied
through that view, in place. So where an element lives is still decided by the runtime
(its conversion table), never by a family rule written here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from nemo_dcr import dtypes
from nemo_dcr.checkpoint import read_specs
from nemo_dcr.errors import ApplyError
from nemo_dcr.runtimes import scatter
from nemo_dcr.runtimes.base import Catalog
from nemo_dcr.runtimes.intercept import NativeLoaderAdapter
from nemo_dcr.runtimes.loader_trace import module_fingerprint, module_storages, storage_key
from nemo_dcr.runtimes.private_memory import privatize


@dataclass(frozen=True)
class StridedView:
    """A checkpoint tensor that is one strided region of the model tensor `key`."""

    key: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements, from the start of `key`

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t.as_strided(self.shape, self.stride, t.storage_offset() + self.offset)


def _revert(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5 keeps checkpoint names in memory
        return state
    return revert_weight_conversion(model, state)


def _strided(key: str, ids: torch.Tensor) -> StridedView | None:
    """The strided view of `key` whose flat indices are `ids`, if there is one."""
    if ids.numel() == 0:
        return None
    flat = ids.reshape(-1)
    offset = int(flat[0])
    stride = tuple(int(ids[tuple(1 if d == k else 0 for d in range(ids.dim()))]) - offset
                   if ids.shape[k] > 1 else 0 for k in range(ids.dim()))
    if any(s < 0 for s in stride):
        return None
    expected = torch.arange(offset + 1 + sum((n - 1) * s for n, s in zip(ids.shape, stride)),
                            dtype=ids.dtype).as_strided(tuple(ids.shape), stride, offset)
    return StridedView(key, tuple(ids.shape), stride, offset) if torch.equal(expected, ids) else None


def checkpoint_views(model: torch.nn.Module) -> tuple[dict[str, str | StridedView], dict[str, str]]:
    """Checkpoint name -> model state_dict key (same tensor) or `StridedView`, and the
    checkpoint names the save path produces but no view can express (name -> why).

    Only model tensors the save path does not pass through unchanged are tagged, one
    at a time, with int32/int64 element indices (a transient copy twice or four times
    that tensor's size at start-up); the tags are not weights, so no value moves.
    """
    state = model.state_dict()
    meta = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in state.items()}
    out_meta = _revert(model, meta)
    names: dict[str, str | StridedView] = {}
    kept_as_is = set()
    for name, t in out_meta.items():
        if name in meta and t is meta[name]:
            names[name] = name
            kept_as_is.add(name)
    unresolved: dict[str, str] = {}
    for key in (k for k in state if k not in kept_as_is):
        numel = state[key].numel()
        tag_dtype = torch.int32 if numel < 2**31 else torch.int64
        tags = torch.arange(numel, dtype=tag_dtype).reshape(state[key].shape)
        for name, ids in _revert(model, {key: tags}).items():
            view = None
            if ids.dtype == tag_dtype and state[key].is_contiguous():
                view = _strided(key, ids)
            if view is None:
                unresolved[name] = f"transformers' save path does not map it onto one strided region of {key}"
            else:
                names[name] = view
    for name in names:
        unresolved.pop(name, None)
    return names, unresolved


class HFRuntime(NativeLoaderAdapter):
    """A transformers `PreTrainedModel` (or any nn.Module) written via its own loaders.

    checkpoint_dir: the version-0 canonical checkpoint; its safetensors headers are
    the catalog. Without it the catalog is the model's checkpoint-named state (what
    `save_pretrained` would write). Either way a tensor stored under two names (tied
    embeddings) is listed once, and checkpoint tensors the model does not hold are
    left out (see `ignored`).
    scratch_device: where the loader's scratch tensors live; default the tensor's own
    device, "meta" to spend no memory on them.
    Tensors that still lie in a memory-mapped checkpoint (how `from_pretrained` leaves a
    CPU model) are first copied into memory of their own (`private_memory.privatize`;
    `privatized_bytes` says how much): applied bits must not follow the file on disk.
    apply_threads: threads for the pause's scatters into CPU storage; None: the cores
    this process may use, at most 8 (`nemo_dcr.runtimes.scatter`).
    """

    canonical_layout = True  # every canonical tensor is a parameter or a view of one

    def __init__(self, model: torch.nn.Module, checkpoint_dir: str | os.PathLike | None = None,
                 scratch_device: str | torch.device | None = None, apply_threads: int | None = None):
        self.apply_threads = apply_threads
        scatter.resolve_threads(apply_threads)  # a bad value fails here, not at the first refit
        self.model = model
        self.privatized_bytes = privatize(model)
        self.scratch_device = scratch_device
        self._live: dict[str, torch.Tensor] = {}
        self._names, unresolved = checkpoint_views(model)
        views = self._views(model.state_dict())
        if checkpoint_dir is None:
            source = {n: (dtypes.from_torch(t.dtype).name, tuple(t.shape)) for n, t in views.items()}
        else:
            try:
                source = read_specs(checkpoint_dir)
            except (FileNotFoundError, ValueError) as exc:  # no safetensors, duplicate, bad dtype
                raise ApplyError(f"cannot read the catalog of {checkpoint_dir}: {exc}") from exc
        self.ignored: dict[str, str] = {}
        try:
            tied_targets = set(model.get_expanded_tied_weights_keys())
        except Exception:
            tied_targets = set()
        groups: dict[tuple, list[str]] = {}  # names that are one storage region
        for name in source:
            t = views.get(name)
            if t is None:
                self.ignored[name] = unresolved.get(name, "the model has no such parameter or buffer")
                continue
            alias = (storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            groups.setdefault(alias, []).append(name)
        keep = set()
        for names in groups.values():
            kept = next((n for n in names if n not in tied_targets), names[0])
            keep.add(kept)
            self.ignored.update({n: f"tied to {kept}" for n in names if n != kept})
        self._catalog: Catalog = {n: e for n, e in source.items() if n in keep}

    def _views(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint name -> the model's tensor (or view) holding it, from `state`."""
        return {n: state[v] if isinstance(v, str) else v.of(state[v.key])
                for n, v in self._names.items() if (v if isinstance(v, str) else v.key) in state}

    def catalog(self) -> Catalog:
        return dict(self._catalog)

    def canonical_state(self) -> dict[str, torch.Tensor]:
        views = self._views(self.model.state_dict())
        return {n: views[n] for n in self._catalog if n in views}

    def _destinations(self) -> dict[int, str]:
        return module_storages(self.model)

    def _canonical_tensor(self, name: str) -> torch.Tensor:
        t = self._live.get(name)
        if t is not None:
            return t
        destinations = self._destinations()
        views = self._views(self.model.state_dict())
        self._live = {n: v for n, v in views.items() if n in self._catalog and storage_key(v) in destinations}
        if name not in views:
            raise ApplyError(f"{name}: the model's state_dict does not contain it")
        return views[name]

    def _layout(self) -> tuple:
        # storage, and what can change `load_state_dict` without changing it: the load hooks
        return module_fingerprint(self.model)

    def _refresh(self) -> None:
        self._live = {}  # parameters may have moved or been replaced since the last call

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        # A loader that rebinds a parameter (`p.data = x`, assign=True) would leave the
        # model on the scratch: put every binding back before failing closed.
        bound = [(store, key, t, t.data) for m in self.model.modules()
                 for store in (m._parameters, m._buffers) for key, t in store.items() if t is not None]
        direct = {n: t for n, t in tensors.items() if not isinstance(self._names.get(n), StridedView)}
        converted = {n: t for n, t in tensors.items() if n not in direct}
        try:
            self.model.load_state_dict(direct, strict=False)
            if converted:
                views = self._views(self.model.state_dict())
                with torch.no_grad():
                    for name, t in converted.items():
                        views[name].copy_(t)  # transformers' own conversion, read backwards
        finally:
            moved = [key for store, key, t, data in bound
                     if store.get(key) is not t or storage_key(t) != storage_key(data)]
            for store, key, t, data in bound:
                store[key] = t
                if storage_key(t) != storage_key(data):
                    t.data = data
        if moved:
            raise ApplyError(f"the loader rebinds {moved[0]!r} instead of copying into it")
