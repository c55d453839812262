"""One NeMo RL update on a vLLM worker's receiver: handle events until a transfer commits.

NeMo RL calls the vLLM side once per refit, beside the policy's send. The receiver then
takes whatever comes (a dense resync first, where it needs one; in-place retries of an
attempt) until a transfer to a new version commits, or is aborted, or nothing is
decided within the timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class UpdateFailed(RuntimeError):
    """The transfer did not commit: the worker still serves the previous version."""


def finish_transfer(receiver: Callable, end, receiver_id: str, timeout_s: float,
                    on_catalog: Callable | None = None, poll_s: float = 0.05):
    """Return the committed attempt (its `stage_s`, `apply_s`: the in-place write) once
    a transfer (not a resync) committed on `receiver()`; raise
    UpdateFailed when one this receiver saw begin is aborted, on shutdown, or after
    `timeout_s`. `receiver` returns the current `Receiver` (None until the first
    catalog built it); `on_catalog(event)` takes catalog messages (they are released
    here otherwise)."""
    deadline = time.monotonic() + timeout_s
    begun: set[str] = set()
    while True:
        rx = receiver()
        if time.monotonic() > deadline:
            serving = None if rx is None else rx.serving_version
            raise UpdateFailed(f"receiver {receiver_id}: no transfer committed within {timeout_s:.0f} s "
                               f"(serving version {serving})")
        event = end.poll(poll_s)
        if event is None:
            continue
        kind, meta = event.kind, event.meta
        if kind == "catalog" and on_catalog is not None:
            on_catalog(event)
            continue
        if rx is None:  # nothing to take it with yet: the catalog comes first
            event.release()
            continue
        cur = rx.current
        ours = cur is not None and not cur.info.resync and cur.info.transfer_id == meta.get("transfer_id")
        alive = rx.handle(event)
        if rx.refused is not None:
            continue  # forged, replayed or from an older trainer: it decides nothing here either
        if kind == "begin" and not (meta.get("transfer") or {}).get("resync"):
            begun.add(str(meta.get("transfer_id")))
        if kind == "commit" and ours and rx.current is None:
            return cur
        if kind == "abort" and meta.get("transfer_id") in begun:
            raise UpdateFailed(f"receiver {receiver_id}: transfer {meta.get('transfer_id')} aborted: "
                               f"{meta.get('reason')} (serving version {rx.serving_version})")
        if not alive:
            raise UpdateFailed(f"receiver {receiver_id}: the trainer shut the receivers down")
