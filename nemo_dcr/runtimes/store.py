"""A receiver over a plain canonical tensor store: name -> tensor, nothing else.

For receivers whose weights are the canonical checkpoint itself (an FP8 rollout
checkpoint held for a serving engine that reads it, a staging copy, tests): the
"native loader" is `dest.copy_(src)` per name, so the runtime-agnostic engine in
`nemo_dcr.runtimes.intercept` plans every tensor as one identity copy and applies
records sparsely on the bit view, with its undo log. Any dtype `nemo_dcr.dtypes`
names works, F8_E4M3 weights and F32/BF16 scales included.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from nemo_dcr import dtypes
from nemo_dcr.checkpoint import safetensors_files
from nemo_dcr.errors import ApplyError
from nemo_dcr.runtimes.base import Catalog
from nemo_dcr.runtimes.intercept import NativeLoaderAdapter
from nemo_dcr.runtimes.loader_trace import storage_key
from nemo_dcr.runtimes.private_memory import privatize_tensors


class TensorStoreRuntime(NativeLoaderAdapter):
    """Records applied in place into a dict of canonical tensors (held, not copied).

    Every tensor must have its own storage: two names sharing one would receive each
    record twice, so aliases are refused (ApplyError naming both). A tensor that still
    lies in a memory-mapped file (`safetensors.torch.load_file` leaves them so) is first
    pointed at a copy of its own (`private_memory.privatize_tensors`; the same tensor
    object): applied bits must not follow the file on disk.
    """

    canonical_layout = True  # the tensors are the canonical ones

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        owners: dict[int, str] = {}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise ApplyError(f"{name!r}: not a tensor ({type(t).__name__})")
            try:
                dtypes.from_torch(t.dtype)
            except ValueError as e:
                raise ApplyError(f"{name!r}: {e}") from None
            key = storage_key(t)
            if key in owners:
                raise ApplyError(f"{name!r} shares its storage with {owners[key]!r}: clone one of them")
            owners[key] = name
        # After the checks: a store refused above leaves the caller's tensors where they were.
        self.privatized_bytes = privatize_tensors(tensors.values())
        self.tensors: dict[str, torch.Tensor] = {name: t.detach() for name, t in tensors.items()}
        self._catalog: Catalog = {n: (dtypes.from_torch(t.dtype).name, tuple(t.shape)) for n, t in self.tensors.items()}

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike, device: str | torch.device = "cpu") -> TensorStoreRuntime:
        """Every tensor of a safetensors checkpoint folder, loaded into memory (each in
        its own storage, not tied to the files)."""
        from safetensors import safe_open

        tensors: dict[str, torch.Tensor] = {}
        for path in safetensors_files(directory):
            with safe_open(path, framework="pt", device=str(device)) as f:
                for name in f.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                    if name in tensors:
                        raise ApplyError(f"tensor {name!r} appears in more than one file of {directory}")
                    tensors[name] = f.get_tensor(name).clone()
        return cls(tensors)

    def catalog(self) -> Catalog:
        return dict(self._catalog)

    def canonical_state(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def _canonical_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def _destinations(self) -> dict[int, str]:
        return {storage_key(t): n for n, t in self.tensors.items()}

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, src in tensors.items():
                self.tensors[name].copy_(src)
