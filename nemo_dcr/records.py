"""What travels: records (one canonical tensor's changes) grouped into payloads, and the
transfer they belong to (`TransferInfo`, which every end and the commit log name)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
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


@dataclass(frozen=True)
class TransferInfo:
    """One attempt of a transfer base_version -> target_version (or a resync): what every
    payload header, control message and commit record names."""

    transfer_id: str
    base_version: int
    target_version: int
    producers: tuple[str, ...]
    # In-place retries: attempt n > 0 re-sends, as overwrites, what attempt 0 (whose id is
    # `lineage`) may have left half-applied; receivers keep their apply journal across them.
    attempt: int = 0
    lineage: str = ""  # "" on the first attempt: its own transfer id
    readback: bool = False  # receivers read applied regions back; their digests are checked before the commit
    # The producers' whole-state digest of base_version (`nemo_dcr.digest`, 32 hex digits):
    # a receiver whose own digest differs refuses the transfer before writing anything.
    base_digest: str = ""
    # A dense resync (base_version == target_version): the producers send every element they
    # own as overwrites; receivers whose state matches base_digest take none of it.
    resync: bool = False

    @property
    def lineage_id(self) -> str:
        return self.lineage or self.transfer_id

    def retry(self) -> "TransferInfo":
        """The next attempt of the same v -> v+1 transfer (a fresh id, so no payload of an
        earlier attempt is ever taken for one of this one)."""
        n = self.attempt + 1
        return TransferInfo(f"{self.lineage_id}-r{n}", self.base_version, self.target_version, self.producers,
                            n, self.lineage_id, self.readback, self.base_digest, self.resync)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "TransferInfo":
        return cls(str(d["transfer_id"]), int(d["base_version"]), int(d["target_version"]),
                   tuple(str(p) for p in d["producers"]), int(d.get("attempt", 0)), str(d.get("lineage", "")),
                   bool(d.get("readback", False)), str(d.get("base_digest", "")), bool(d.get("resync", False)))
