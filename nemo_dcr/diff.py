"""The hot loop: changed positions and their xor / add / new values, vectorised.

Works on integer bit views (int16 for BF16), so NaNs, -0.0 and every other bit
pattern compare by their stored bits. Runs on whatever device the tensors are on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Delta:
    positions: torch.Tensor  # int64, sorted, relative to the diffed slice
    new: torch.Tensor  # new bits at positions
    old: torch.Tensor  # committed bits at positions

    def xor(self) -> torch.Tensor:
        return torch.bitwise_xor(self.new, self.old)

    def add(self) -> torch.Tensor:
        # Two's-complement wrap-around: (new - old) mod 2**width on the bit view.
        return self.new - self.old

    def __len__(self) -> int:
        return int(self.positions.numel())


def diff(current: torch.Tensor, committed: torch.Tensor) -> Delta:
    """Positions where the bits of `current` differ from `committed` (same shape/dtype)."""
    if current.shape != committed.shape or current.dtype != committed.dtype:
        raise ValueError(
            f"diff needs equal shapes and dtypes, got {tuple(current.shape)}/{current.dtype} "
            f"vs {tuple(committed.shape)}/{committed.dtype}"
        )
    positions = torch.ne(current, committed).nonzero().view(-1)
    return Delta(positions, current[positions], committed[positions])
