"""Hugging Face transformers receiver: records applied through `load_state_dict`.

`HFRuntime` is the Hugging Face half of the receiver: it runs `load_state_dict` as the
native loader, names every parameter and buffer as model storage, and builds the
catalog from the version-0 checkpoint's safetensors headers (`nemo_dcr.checkpoint.
read_specs`) or the model's state_dict, listing tied aliases once. Interception,
planning, application and undo are the runtime-agnostic engine in
`nemo_dcr.runtimes.intercept`.
"""

from __future__ import annotations

import os

import torch

from nemo_dcr import dtypes
from nemo_dcr.checkpoint import read_specs
from nemo_dcr.errors import ApplyError
from nemo_dcr.runtimes.base import Catalog
from nemo_dcr.runtimes.intercept import NativeLoaderAdapter, storage_key


class HFRuntime(NativeLoaderAdapter):
    """A transformers `PreTrainedModel` (or any nn.Module) written via `load_state_dict`.

    checkpoint_dir: the version-0 canonical checkpoint; its safetensors headers are
    the catalog. Without it the catalog is the model's state_dict. Either way a tensor
    stored under two names (tied embeddings) is listed once, and checkpoint tensors the
    model does not hold are left out (see `ignored`).
    scratch_device: where the loader's scratch tensors live; default the tensor's own
    device, "meta" to spend no memory on them.
    """

    def __init__(self, model: torch.nn.Module, checkpoint_dir: str | os.PathLike | None = None,
                 scratch_device: str | torch.device | None = None):
        self.model = model
        self.scratch_device = scratch_device
        self._live: dict[str, torch.Tensor] = {}
        state = model.state_dict()
        if checkpoint_dir is None:
            source = {n: (dtypes.from_torch(t.dtype).name, tuple(t.shape)) for n, t in state.items()}
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
            t = state.get(name)
            if t is None:
                self.ignored[name] = "the model has no such parameter or buffer"
                continue
            alias = (storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            groups.setdefault(alias, []).append(name)
        keep = set()
        for names in groups.values():
            kept = next((n for n in names if n not in tied_targets), names[0])
            keep.add(kept)
            self.ignored.update({n: f"tied to {kept}" for n in names if n != kept})
        self._catalog: Catalog = {n: e for n, e in source.items() if n in keep}

    def catalog(self) -> Catalog:
        return dict(self._catalog)

    def canonical_state(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        return {n: state[n] for n in self._catalog if n in state}

    def _destinations(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for name, t in list(self.model.named_parameters(remove_duplicate=False)) + list(
            self.model.named_buffers(remove_duplicate=False)
        ):
            if t is not None:
                out.setdefault(storage_key(t), name)
        return out

    def _canonical_tensor(self, name: str) -> torch.Tensor:
        t = self._live.get(name)
        if t is not None:
            return t
        state = self.model.state_dict()
        destinations = self._destinations()
        self._live = {n: v for n, v in state.items() if n in self._catalog and storage_key(v) in destinations}
        if name not in state:
            raise ApplyError(f"{name}: the model's state_dict does not contain it")
        return state[name]

    def _refresh(self) -> None:
        self._live = {}  # parameters may have moved or been replaced since the last call

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        # A loader that rebinds a parameter (`p.data = x`, assign=True) would leave the
        # model on the scratch: put every binding back before failing closed.
        bound = [(store, key, t, t.data) for m in self.model.modules()
                 for store in (m._parameters, m._buffers) for key, t in store.items() if t is not None]
        try:
            self.model.load_state_dict(tensors, strict=False)
        finally:
            moved = [key for store, key, t, data in bound
                     if store.get(key) is not t or storage_key(t) != storage_key(data)]
            for store, key, t, data in bound:
                store[key] = t
                if storage_key(t) != storage_key(data):
                    t.data = data
        if moved:
            raise ApplyError(f"the loader rebinds {moved[0]!r} instead of copying into it")
