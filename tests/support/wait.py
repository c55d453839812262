"""Bounded waits for asynchronous effects (receivers take the commit message on their
own thread, after the trainer's `refit()` has returned)."""

from __future__ import annotations

import time


def until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.01)


def serving(receivers, version: int, timeout_s: float = 10.0) -> None:
    """Wait until every receiver serves `version`."""
    until(lambda: all(r.serving_version == version for r in receivers), timeout_s,
          f"every receiver serving version {version} "
          f"(now {[r.serving_version for r in receivers]})")
