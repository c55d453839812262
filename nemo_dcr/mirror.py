"""A receiver's canonical host mirror: the committed bits of every canonical tensor, in
canonical layout, kept in step with what the runtime applies.

Baseline-conditioned records (nemo_dcr.wire.conditioned) decode against the old bits of a
span of a canonical tensor. A runtime that holds its tensors in canonical layout (a Hugging
Face model, a tensor store) reads them in place (`RuntimeAdapter.committed_bits`). One that
does not - vLLM fuses QKV and gate/up, repacks weights for its kernels, and under tensor
parallelism a worker holds only its shard - keeps this mirror instead: host memory of one
copy of the canonical model (2 bytes a BF16 parameter), moved by every apply and revert in
O(changes).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from nemo_dcr import dtypes
from nemo_dcr.errors import ApplyError
from nemo_dcr.records import Op, Record


class CanonicalMirror:
    """Canonical name -> committed bits (a flat array of unsigned integers, host memory)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor | np.ndarray]):
        self.bits_by_name: dict[str, np.ndarray] = {}
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor):
                t = dtypes.bits_of(t.detach()).reshape(-1).cpu().numpy()
            a = np.array(t, copy=True).reshape(-1)
            self.bits_by_name[name] = a.view(np.dtype(f"u{a.itemsize}"))  # unsigned, as records carry bits

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
                for name in f.keys():
                    if wanted is None or name in wanted:
                        tensors[name] = f.get_tensor(name)
        if wanted is not None and wanted - tensors.keys():
            missing = sorted(wanted - tensors.keys())
            raise ApplyError(f"checkpoint {directory} lacks {len(missing)} tensor(s) the mirror needs: {missing[:5]}")
        return cls(tensors)

    @property
    def nbytes(self) -> int:
        """Host memory the mirror holds."""
        return sum(b.nbytes for b in self.bits_by_name.values())

    def bits(self, name: str, lo: int, hi: int) -> np.ndarray | None:
        b = self.bits_by_name.get(name)
        return None if b is None or not 0 <= lo <= hi <= b.size else b[lo:hi]

    def apply(self, records: Sequence[Record]) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """Apply records as the runtime did; returns what `revert` needs (the old bits of
        the positions written). Records of tensors the mirror does not hold are skipped."""
        undo = []
        for r in records:
            b = self.bits_by_name.get(r.name)
            if b is None or len(r) == 0:
                continue
            idx = np.asarray(r.positions).astype(np.int64, copy=False)
            vals = np.asarray(r.values).view(b.dtype)
            old = b[idx]
            op = Op(r.op)
            b[idx] = old ^ vals if op is Op.XOR else (old + vals) if op is Op.ADD else vals
            undo.append((r.name, idx, old))
        return undo

    def revert(self, undo: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
        """Put back the bits an `apply` overwrote, newest first."""
        for name, idx, old in reversed(undo):
            self.bits_by_name[name][idx] = old
