"""Fault injection around real components (tests and the fault campaign).

- `HalfApply`: a runtime adapter wrapper whose chosen apply calls write the first half of
  their records and then raise, leaving them written: what a receiver interrupted
  between records leaves behind (the real adapters revert a failed call).
- `SilentCorruption`: a runtime wrapper whose chosen apply calls succeed but leave one
  written element with a flipped bit (a faulty kernel or memory): only read-back sees it.
- `FaultyEnd`: a producer end wrapper that drops, corrupts, duplicates or delays chosen
  payloads on their first send (later sends of the same id go through untouched).
"""

from __future__ import annotations

from collections.abc import Sequence

from nemo_dcr import dtypes
from nemo_dcr.errors import ApplyError
from nemo_dcr.records import Record
from nemo_dcr.runtimes.base import Catalog, RuntimeAdapter, UndoLog
from nemo_dcr.transport import ProducerEnd, TransferInfo


class HalfApply(RuntimeAdapter):
    def __init__(self, inner: RuntimeAdapter, crash_on: Sequence[int] = (1,)):
        """`crash_on`: 1-based numbers of the apply calls to interrupt."""
        self.inner, self.crash_on, self.calls, self.crashes = inner, set(crash_on), 0, 0

    def catalog(self) -> Catalog:
        return self.inner.catalog()

    def check(self, records: Sequence[Record]) -> None:
        self.inner.check(records)

    def apply(self, records: Sequence[Record]) -> UndoLog:
        self.calls += 1
        if self.calls not in self.crash_on:
            return self.inner.apply(records)
        records = list(records)
        half = max(1, len(records) // 2) if records else 0
        self.inner.apply(records[:half])  # written, and never reverted
        self.crashes += 1
        raise ApplyError(f"injected: apply interrupted after {half} of {len(records)} records")

    def revert(self, log: UndoLog) -> None:
        self.inner.revert(log)

    def canonical_state(self):
        return self.inner.canonical_state()


class SilentCorruption(HalfApply):
    def apply(self, records: Sequence[Record]) -> UndoLog:
        self.calls += 1
        log = self.inner.apply(records)
        hit = next((r for r in records if len(r)), None)
        if self.calls in self.crash_on and hit is not None:
            flat = dtypes.bits_of(self.inner.canonical_state()[hit.name].detach()).view(-1)
            flat[int(hit.positions[0])] ^= 1
            self.crashes += 1
        return log


class FaultyEnd(ProducerEnd):
    KINDS = ("drop", "corrupt", "duplicate", "delay")

    def __init__(self, inner: ProducerEnd, faults: dict[str, str]):
        """`faults`: payload id -> one of KINDS, applied on that id's first send. "delay"
        holds the payload back until the next send (or the flush): a reordering."""
        bad = {k for k in faults.values() if k not in self.KINDS}
        if bad:
            raise ValueError(f"unknown fault kinds {sorted(bad)}; choose from {self.KINDS}")
        self.inner, self.pending = inner, dict(faults)
        self.injected: dict[str, int] = dict.fromkeys(self.KINDS, 0)
        self.held: list[tuple] = []

    def send(self, transfer: TransferInfo, payload_id: str, data: bytes) -> None:
        kind = self.pending.pop(payload_id, None)
        if kind is not None:
            self.injected[kind] += 1
        if kind == "drop":
            return
        if kind == "delay":
            self.held.append((transfer, payload_id, data))
            return
        if kind == "corrupt":
            data = bytearray(data)
            data[len(data) // 2] ^= 0x40
            data = bytes(data)
        self.inner.send(transfer, payload_id, data)
        if kind == "duplicate":
            self.inner.send(transfer, payload_id, data)
        self._release_held()

    def _release_held(self) -> None:
        held, self.held = self.held, []
        for args in held:
            self.inner.send(*args)

    def flush(self, transfer: TransferInfo, payload_ids: list[str]) -> dict:
        self._release_held()
        return self.inner.flush(transfer, payload_ids)

    def close(self) -> None:
        self.inner.close()
