"""Producer baselines: the bits of the last *committed* version of each owned range.

Not the pre-step bits: a refit can fail or be skipped, and the next delta must be
taken against what receivers actually hold. A transfer in flight keeps only its
sparse changes as pending (positions + new bits), so the producer holds one dense
copy of what it owns, not two; `commit()` scatters the pending changes in.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class _Pending:
    positions: list[torch.Tensor] = field(default_factory=list)
    new: list[torch.Tensor] = field(default_factory=list)


class Baseline:
    """Committed bits per owned range, in RAM or file-backed (mmap)."""

    def __init__(self, version: int = 0, directory: str | os.PathLike | None = None):
        self.version = version
        self.directory = directory
        self._committed: dict[str, torch.Tensor] = {}
        self._pending: dict[str, _Pending] | None = None
        self._pending_target: int | None = None
        if directory is not None:
            os.makedirs(directory, exist_ok=True)

    def register(self, key: str, bits: torch.Tensor) -> None:
        """Record the committed bits of a range (a copy; `bits` is an integer bit view)."""
        if key in self._committed:
            raise ValueError(f"baseline range {key!r} registered twice")
        src = bits.detach().reshape(-1).cpu()
        if self.directory is None:
            self._committed[key] = src.clone()
            return
        path = os.path.join(self.directory, _file_name(key))
        np_dtype = np.dtype(f"<i{src.element_size()}") if src.dtype != torch.uint8 else np.uint8
        mm = np.memmap(path, dtype=np_dtype, mode="w+", shape=(src.numel(),))
        mm[:] = src.numpy()
        mm.flush()
        self._committed[key] = torch.from_numpy(mm)

    def committed(self, key: str) -> torch.Tensor:
        return self._committed[key]

    def keys(self):
        return self._committed.keys()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._committed.values())

    # --- transfer lifecycle -------------------------------------------------------

    def begin(self, target_version: int) -> None:
        if target_version != self.version + 1:
            raise ValueError(f"baseline at version {self.version} cannot start a transfer to {target_version}")
        self._pending, self._pending_target = {}, target_version

    def stage(self, key: str, positions: torch.Tensor, new: torch.Tensor) -> None:
        """Remember changed positions (relative to the range) and their new bits."""
        if self._pending is None:
            raise RuntimeError("stage() outside a transfer: call begin() first")
        p = self._pending.setdefault(key, _Pending())
        p.positions.append(positions.cpu())
        p.new.append(new.cpu())

    def commit(self) -> int:
        """Make the pending transfer's bits the committed baseline (joint commit)."""
        if self._pending is None:
            raise RuntimeError("commit() without a transfer in flight")
        for key, p in self._pending.items():
            if p.positions:
                self._committed[key][torch.cat(p.positions)] = torch.cat(p.new)
        self.version = self._pending_target
        self._pending = self._pending_target = None
        return self.version

    def abort(self) -> None:
        """Drop the pending transfer; the committed version stays as it was."""
        self._pending = self._pending_target = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None


def _file_name(key: str) -> str:
    # Readable and collision-free: sanitised key plus a short hash of the exact key.
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in key)[:120]
    return f"{safe}-{hashlib.blake2b(key.encode(), digest_size=6).hexdigest()}.bits"
