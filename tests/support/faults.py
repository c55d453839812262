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

import contextlib
from collections.abc import Sequence

from nemo_dcr import dtypes
from nemo_dcr.errors import ApplyError
from nemo_dcr.records import Record, TransferInfo
from nemo_dcr.runtimes.base import Catalog, RuntimeAdapter, UndoLog
from nemo_dcr.transport import ProducerEnd


class ReceiverCrash(BaseException):
    """Raised through a receiver's event loop: the thread ends, as a killed process would."""


class FaultyRuntime(RuntimeAdapter):
    """Delegates to a runtime; chosen apply calls (1-based, `crash_on`, or armed later with
    `arm`) misbehave, each in one `mode`:

    - "half": write the first half of the call's records, then raise ApplyError, leaving
      them written (an apply interrupted between records);
    - "crash": the same, then raise ReceiverCrash (the receiver dies mid-apply);
    - "silent": apply everything, then flip one written bit and return normally.

    `fail_batch_end`: the next `batch()` fails when it ends, after its applies succeeded
    (a serving runtime's post-load processing failing once per batch).
    """

    MODES = ("half", "crash", "silent")
    fail_batch_end = False

    def __init__(self, inner: RuntimeAdapter, mode: str = "half", crash_on: Sequence[int] = ()):
        if mode not in self.MODES:
            raise ValueError(f"unknown fault mode {mode!r}; choose from {self.MODES}")
        self.inner, self.mode, self.crash_on, self.calls, self.crashes = inner, mode, set(crash_on), 0, 0

    def arm(self, mode: str, after_calls: int = 1) -> None:
        """Misbehave in `mode` on the `after_calls`-th apply call from now."""
        if mode not in self.MODES:
            raise ValueError(f"unknown fault mode {mode!r}; choose from {self.MODES}")
        self.mode, self.crash_on = mode, {self.calls + after_calls}

    def catalog(self) -> Catalog:
        return self.inner.catalog()

    def check(self, records: Sequence[Record]) -> None:
        self.inner.check(records)

    @contextlib.contextmanager
    def batch(self):
        with self.inner.batch():
            yield
        if self.fail_batch_end:
            self.fail_batch_end = False
            raise ApplyError("injected: the batch's post-load processing failed")

    def apply(self, records: Sequence[Record]) -> UndoLog:
        self.calls += 1
        if self.calls not in self.crash_on:
            return self.inner.apply(records)
        self.crashes += 1
        records = list(records)
        if self.mode == "silent":
            log = self.inner.apply(records)
            hit = next((r for r in records if len(r)), None)
            if hit is not None:
                flat = dtypes.bits_of(self.inner.canonical_state()[hit.name].detach()).view(-1)
                flat[int(hit.positions[0])] ^= 1
            return log
        half = max(1, len(records) // 2) if records else 0
        self.inner.apply(records[:half])  # written, and never reverted
        what = f"injected: apply interrupted after {half} of {len(records)} records"
        raise ReceiverCrash(what) if self.mode == "crash" else ApplyError(what, bits_unknown=True)

    def revert(self, log: UndoLog) -> None:
        self.inner.revert(log)

    def canonical_state(self):
        return self.inner.canonical_state()


def HalfApply(inner: RuntimeAdapter, crash_on: Sequence[int] = (1,)) -> FaultyRuntime:  # noqa: N802
    return FaultyRuntime(inner, "half", crash_on)


def SilentCorruption(inner: RuntimeAdapter, crash_on: Sequence[int] = (1,)) -> FaultyRuntime:  # noqa: N802
    return FaultyRuntime(inner, "silent", crash_on)


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
