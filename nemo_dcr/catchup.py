"""Catch-up: take a receiver to the newest committed version from the history
(`nemo_dcr.history`), for receivers that restarted, joined late, or hold uncertain bits.

The chain is chosen first and checked whole before anything is written: either the
deltas after the version the receiver serves (when its bits are known: a fresh load of
the initial checkpoint, or a receiver that fell behind), or the newest complete anchor
and the deltas after it. Every link is replayed exactly once, in order; each payload is
decoded and checked like a live one (checksum, HMAC, transfer id and versions from the
signed manifest, names and shapes against the receiver's catalog). A missing, pruned or
incomplete link is a HistoryError naming the version, before any write. A failure while
applying leaves the receiver marked uncertain (it refuses transfers), and a new catch-up
from an anchor repairs it, since anchors are overwrites.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nemo_dcr.errors import PayloadRejected
from nemo_dcr.history import ANCHORS, DELTAS, History, HistoryError
from nemo_dcr.wire import codec


@dataclass
class CatchUpReport:
    start: int  # the version the chain starts from (an anchor's, or what the receiver served)
    version: int  # the version the receiver serves now
    anchor: int | None = None
    deltas: list[int] = field(default_factory=list)
    payloads: int = 0
    bytes: int = 0
    seconds: float = 0.0


class _Manifests:
    """Manifest lookups, each read at most once (planning and replay ask for the same ones)."""

    def __init__(self, history: History, key: bytes | None):
        self.history, self.key, self.seen = history, key, {}

    def __call__(self, kind: str, version: int) -> dict[str, str] | None:
        if (kind, version) not in self.seen:
            self.seen[kind, version] = self.history.manifest(kind, version, self.key)
        return self.seen[kind, version]


def latest_version(history: History, key: bytes | None, manifest=None) -> int:
    """The newest version the history can take a receiver to (complete entries only)."""
    manifest = manifest or _Manifests(history, key)
    newest = [v for kind in (DELTAS, ANCHORS) for v in history.versions(kind)]
    for v in sorted(set(newest), reverse=True):
        if manifest(DELTAS, v) is not None or manifest(ANCHORS, v) is not None:
            return v
    return 0


def plan(history: History, key: bytes | None, *, serving: int | None, target: int | None = None,
         manifest=None) -> tuple[int | None, list[int], int]:
    """(anchor version or None, delta versions to replay in order, target version)."""
    manifest = manifest or _Manifests(history, key)
    target = latest_version(history, key, manifest) if target is None else target

    def deltas_from(v: int) -> list[int] | None:
        chain = list(range(v + 1, target + 1))
        return chain if all(manifest(DELTAS, n) is not None for n in chain) else None

    if serving is not None and serving <= target:
        chain = deltas_from(serving)
        if chain is not None:
            return None, chain, target
    anchors = [v for v in history.versions(ANCHORS) if v <= target and manifest(ANCHORS, v) is not None]
    for a in reversed(anchors):
        chain = deltas_from(a)
        if chain is not None:
            return a, chain, target
    start = anchors[-1] if anchors else serving
    gap = next((n for n in range((start or 0) + 1, target + 1) if manifest(DELTAS, n) is None), None)
    where = f"anchors at {anchors}" if anchors else "no complete anchor"
    raise HistoryError(f"catch-up to version {target} is impossible: the delta of version {gap} is missing "
                       f"(pruned, or never stored) and there are {where}"
                       + (f"; the receiver serves {serving}" if serving is not None else
                          "; the receiver's bits are unknown, so it needs an anchor"))


def catch_up(receiver, history: History, *, target: int | None = None, log=None) -> CatchUpReport:
    """Bring `receiver` (a `nemo_dcr.receiver.Receiver`, not serving events meanwhile) to
    the newest committed version in `history` (or `target`)."""
    log = log or receiver.log
    t0 = time.perf_counter()
    serving = None if receiver.uncertain_state or receiver.lineage is not None else receiver.serving_version
    manifest = _Manifests(history, receiver.key)
    anchor, chain, target = plan(history, receiver.key, serving=serving, target=target, manifest=manifest)
    report = CatchUpReport(start=anchor if anchor is not None else serving, version=target, anchor=anchor,
                           deltas=chain)
    if anchor is None and not chain:
        return report  # already there
    log(f"[{receiver.id}] catching up to version {target}: "
        + (f"anchor v{anchor}, " if anchor is not None else f"from v{serving}, ") + f"{len(chain)} delta(s)")
    receiver.lineage = receiver.current = None
    try:
        if anchor is not None:
            # Overwrites, applied one payload at a time (an anchor is the whole model).
            receiver.uncertain_state = f"catch-up from anchor v{anchor} did not finish"
            for pid, tid in sorted(manifest(ANCHORS, anchor).items()):
                _apply(receiver, history, report, ANCHORS, anchor, pid, codec.Expected(tid, anchor, anchor))
            receiver.serving_version, receiver.uncertain_state = anchor, None
        for v in chain:
            # A delta is decoded whole before any of it is written: it applies only to exact v-1.
            staged = [(pid, _decode(receiver, history, report, DELTAS, v, pid, codec.Expected(tid, v - 1, v)))
                      for pid, tid in sorted(manifest(DELTAS, v).items())]
            receiver.uncertain_state = f"catch-up stopped inside the delta of version {v}"
            for _, payload in staged:
                receiver.apply_records([r for r in payload.records if r.name in receiver.held])
            receiver.serving_version, receiver.uncertain_state = v, None
    except PayloadRejected as e:
        raise HistoryError(f"catch-up to version {target}: {e}") from None
    report.seconds = time.perf_counter() - t0
    log(f"[{receiver.id}] caught up to version {target} in {report.seconds:.2f} s "
        f"({report.payloads} payloads, {report.bytes} bytes)")
    return report


def _decode(receiver, history, report, kind, version, pid, expected):
    data = history.get_payload(kind, version, pid)
    payload = codec.decode(data, key=receiver.key, catalog=receiver.catalog, limits=receiver.limits,
                           expected=expected, baselines=receiver.baselines,
                           held=receiver.held, threads=receiver.decode_threads)
    if payload.header.payload_id != pid:
        raise PayloadRejected(pid, f"stored under {pid} but its header names {payload.header.payload_id}")
    report.payloads += 1
    report.bytes += len(data)
    return payload


def _apply(receiver, history, report, kind, version, pid, expected) -> None:
    payload = _decode(receiver, history, report, kind, version, pid, expected)
    receiver.apply_records([r for r in payload.records if r.name in receiver.held])
