"""Where a trainer rank sits and what it owns after an optimizer step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelLayout:
    """One rank's coordinates in the trainer's parallel layout.

    tp/pp/dp: the dense (attention, norms, embeddings) coordinates. ep/etp: expert
    parallelism for MoE layers (Megatron's expert_model_parallel and
    expert_tensor_parallel ranks): expert weights are split over etp, not tp, and each
    EP rank holds num_experts / ep_size consecutive experts. Defaults describe a dense
    model (ep = etp = 1)."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    etp_size: int = 1
    etp_rank: int = 0

    def __post_init__(self):
        for axis in ("tp", "pp", "dp", "ep", "etp"):
            size, rank = getattr(self, f"{axis}_size"), getattr(self, f"{axis}_rank")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"invalid {axis} coordinates: rank {rank} of size {size}")


@dataclass(frozen=True)
class LocalParam:
    """A trainer-local parameter (a TP/PP shard), named the way converters expect.

    name: the Megatron parameter name without wrapper prefixes ("module.") and with
    *global* layer indices, e.g. "decoder.layers.3.mlp.linear_fc1.weight".
    """

    name: str
    local_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(int(s) for s in self.local_shape)


@dataclass
class OwnedRange:
    """The slice [start, stop) of a local parameter's flat view this rank owns.

    `tensor` is a live 1-D view of exactly that slice (no copy); read it after the
    optimizer step to capture the new bits.
    """

    param: LocalParam
    start: int
    stop: int
    tensor: torch.Tensor

    @property
    def key(self) -> str:
        """Stable identity of the range (baselines are keyed by it)."""
        return f"{self.param.name}[{self.start}:{self.stop}]"

    def __len__(self) -> int:
        return self.stop - self.start
