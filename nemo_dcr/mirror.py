"""A receiver's canonical host mirror: the committed bits of every canonical tensor, in
canonical layout, kept in step with what the runtime applies.

Baseline-conditioned records (nemo_dcr.wire.conditioned) decode against the old bits of a
span of a canonical tensor. A runtime that holds its tensors in canonical layout (a Hugging
Face model, a tensor store) reads them in place (`RuntimeAdapter.committed_bits`). One that
does not - vLLM fuses QKV and gate/up, repacks weights for its kernels, and under tensor
parallelism a worker holds only its shard - keeps this mirror instead: host memory of one
copy of the canonical model (2 bytes a BF16 parameter), moved by every apply and revert in
O(changes). The mirror is a tensor store (`TensorStoreRuntime`) of its own copies: records
are applied and undone there exactly as a canonical receiver applies them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from nemo_dcr.errors import ApplyError
from nemo_dcr.records import Record
from nemo_dcr.runtimes.base import UndoLog
from nemo_dcr.runtimes.store import TensorStoreRuntime


class CanonicalMirror:
    """Host copies of canonical tensors by name, moved by the records a receiver applies."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.store = TensorStoreRuntime({name: t.detach().cpu().clone() for name, t in tensors.items()})

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike, names: Iterable[str] | None = None) -> CanonicalMirror:
        """The canonical tensors of a safetensors checkpoint folder (the one the runtime
        loaded), all of them or those `names`; each read once into host memory."""
        from safetensors import safe_open

        from nemo_dcr.checkpoint import safetensors_files

        wanted = None if names is None else set(names)
        tensors = {}
        for path in safetensors_files(directory):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                    if wanted is None or name in wanted:
                        tensors[name] = f.get_tensor(name)
        if wanted is not None and wanted - tensors.keys():
            missing = sorted(wanted - tensors.keys())
            raise ApplyError(f"checkpoint {directory} lacks {len(missing)} tensor(s) the mirror needs: {missing[:5]}")
        return cls(tensors)

    def __len__(self) -> int:
        """The tensors the mirror holds."""
        return len(self.store.tensors)

    @property
    def nbytes(self) -> int:
        """Host memory the mirror holds."""
        return sum(t.nbytes for t in self.store.tensors.values())

    def bits(self, name: str, lo: int, hi: int) -> np.ndarray | None:
        """Tensor `name`'s committed bits at flat positions lo .. hi (unsigned), or None."""
        return self.store.committed_bits(name, lo, hi)

    def apply(self, records: Sequence[Record]) -> UndoLog:
        """Apply records as the runtime did (those of tensors the mirror does not hold are
        skipped); returns what `revert` needs."""
        return self.store.apply([r for r in records if r.name in self.store.tensors])

    def revert(self, undo: UndoLog) -> None:
        """Undo an `apply`."""
        self.store.revert(undo)
