"""What travels: records (one canonical tensor's changes) grouped into payloads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import numpy as np


class Op(str, Enum):
    """How changed elements are carried; all three are bit-exact."""

    XOR = "xor"  # value = new ^ old
    ADD = "add"  # value = (new - old) mod 2**width on the integer view
    OVERWRITE = "overwrite"  # value = new bits


# What a producer is asked for by default: per canonical tensor and payload, xor or add,
# whichever codes smaller (sender.Producer; every record it writes is still xor or add).
# ±1-ULP steps and AdamW deltas code 7-13% smaller as add (benchmarks/results/history.md), at no
# measurable cost; xor stays a choice for data it suits.
AUTO = "auto"


@dataclass(frozen=True)
class BaseSpan:
    """Committed bits of a canonical tensor's flat positions lo .. lo + bits.size (unsigned
    integers of the dtype's width): what producer and receivers both hold before a refit."""

    lo: int
    bits: np.ndarray

    @property
    def hi(self) -> int:
        return self.lo + int(self.bits.size)


@dataclass(frozen=True)
class Record:
    """Changes to one canonical tensor.

    positions: sorted, strictly increasing flat indices (uint64; codec.encode also takes uint32) into `shape`.
    values: unsigned bit values (width = dtype itemsize), one per position.
    codec.encode also takes both as torch tensors on one device (integer positions, integer
    value bits): format v6 codes them there (nemo_dcr.wire.prefix). Decoded records hold arrays.
    base: the committed bits of a span holding every position, which the encoder may code
    the record against (nemo_dcr.wire.conditioned); never on the wire, None when decoded.
    """

    name: str
    dtype: str  # canonical dtype name, see nemo_dcr.dtypes
    shape: tuple[int, ...]
    op: Op
    positions: np.ndarray
    values: np.ndarray
    base: BaseSpan | None = field(default=None, repr=False, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(int(s) for s in self.shape)

    def __len__(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class PayloadHeader:
    """Identity of a payload: retries resend identical bytes under the same identity."""

    transfer_id: str
    base_version: int
    target_version: int
    producer_id: str
    payload_id: str  # unique within the transfer, e.g. "<producer>-<seq>"


@dataclass
class Payload:
    header: PayloadHeader
    records: list[Record] = field(default_factory=list)

    @property
    def changed_elements(self) -> int:
        return sum(len(r) for r in self.records)
