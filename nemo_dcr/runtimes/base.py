"""The receiver-side contract: apply canonical records in place, and undo them.

A runtime adapter sits between canonical records (tensor name, flat positions, bit
values) and a serving runtime's own parameter storage. It never knows a model family:
where a canonical element lands is decided by the runtime's native loader, which the
adapter drives and intercepts (see `nemo_dcr.runtimes.intercept`).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nemo_dcr.digest import StateDigest, state_digest
from nemo_dcr.records import Op, Record

Catalog = dict[str, tuple[str, tuple[int, ...]]]


@dataclass
class UndoLog:
    """What one `apply` changed, oldest first; `revert` undoes it newest first.

    Each step is either a `Record` that undoes one applied record when applied the
    same way (xor is its own inverse, add carries the negated values, overwrite
    carries the old bits of just the overwritten positions), or an adapter-specific
    object for changes that cannot be expressed as a record. A log belongs to the
    adapter that produced it and can be reverted once.

    `digest`: how the apply moved the whole-state digest (`nemo_dcr.digest`), from the
    bits the runtime held before each write and after it; None when the adapter cannot
    tell (the receiver then knows its digest no longer). A revert moves it back exactly.
    """

    steps: list[Any] = field(default_factory=list)
    reverted: bool = False
    digest: StateDigest | None = None
    mirror: UndoLog | None = None  # the receiver's canonical mirror's own (nemo_dcr.mirror)

    def __len__(self) -> int:
        return len(self.steps)


def negated(values: np.ndarray) -> np.ndarray:
    """-values mod 2**width, for unsigned bit values: what undoes an add."""
    return (~values + values.dtype.type(1)).astype(values.dtype, copy=False)


def inverse(record: Record) -> Record:
    """The record that undoes `record` for xor/add (overwrite needs the old bits)."""
    if record.op is Op.XOR:
        return record
    if record.op is Op.ADD:
        return Record(record.name, record.dtype, record.shape, Op.ADD, record.positions,
                      negated(np.asarray(record.values)))
    raise ValueError(f"{record.name}: an overwrite record is undone by the old bits, not inverted")


class RuntimeAdapter(ABC):
    """Applies canonical records in place into one serving runtime's storage."""

    @abstractmethod
    def catalog(self) -> Catalog:
        """Canonical tensor name -> (dtype name as in `nemo_dcr.dtypes`, shape).

        Every tensor a record may name, each storage once (tied aliases excluded).
        """

    @abstractmethod
    def check(self, records: Sequence[Record]) -> None:
        """Raise `ApplyError` naming the record and tensor if one cannot be applied.

        Writes nothing.
        """

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """A context for a run of `apply` calls that nothing else touches the runtime
        between (a receiver's pause): an adapter may check once, for all of them, what it
        otherwise checks on every call (that the model's storage and loaders are still
        those its plans were made for), and may finish once, at the end, work each call
        would otherwise finish (a serving runtime's post-load processing). Each call keeps
        its own all-or-nothing contract; if the finishing work fails, leaving the context
        raises, and the caller reverts every call the batch applied. Default: nothing
        shared."""
        return contextlib.nullcontext()

    @abstractmethod
    def apply(self, records: Sequence[Record]) -> UndoLog:
        """Check all records, then apply them in order, in place.

        On any failure, what this call already applied is reverted before the error
        propagates, so a failed apply leaves every bit unchanged.
        """

    @abstractmethod
    def revert(self, log: UndoLog) -> None:
        """Undo an `apply` (the latest one first when several are stacked)."""

    def committed_bits(self, name: str, lo: int, hi: int) -> np.ndarray | None:
        """Canonical tensor `name`'s bits at flat positions lo .. hi, read in place, for
        decoding baseline-conditioned records (nemo_dcr.wire.conditioned); None (the
        default) where the runtime does not hold them in canonical layout: its receiver
        then keeps a `nemo_dcr.mirror.CanonicalMirror`."""
        return None

    @abstractmethod
    def canonical_state(self) -> dict[str, torch.Tensor]:
        """Current tensors by canonical name, for verification (views are fine)."""

    def state_digest(self) -> StateDigest | None:
        """The whole-state digest of what the runtime holds now, read from its storage
        (O(model)); None when it cannot be read (the bits are not known to be any version,
        e.g. a model initialised with dummy weights whose loader-format copies were never
        written)."""
        return state_digest(self.canonical_state())
