"""The coordinator and the joint commit.

A transfer v -> v+1 commits only when every producer has flushed with no payload
rejected and every receiver has applied the whole transfer. The commit point is a
record for v+1 written to the commit log with compare-and-set semantics
(`nemo_dcr.commit_log`), so two coordinators can never both commit the same version.
After it exists, receivers serve v+1 and producers take v+1 as their baseline; before
it, both stay at v.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

from nemo_dcr.commit_log import AlreadyCommitted, CommitLog, payload_set_digest
from nemo_dcr.control_auth import check, sign
from nemo_dcr.errors import TransportError
from nemo_dcr.records import TransferInfo
from nemo_dcr.transport import CoordinatorEnd


@dataclass
class Decision:
    transfer_id: str
    committed: bool
    version: int  # the version receivers serve and producers diff against from now on
    reasons: list[str] = field(default_factory=list)
    receivers: dict[str, dict] = field(default_factory=dict)  # receiver -> its 'applied' reply

    def to_json(self) -> dict:
        return self.__dict__.copy()


class Coordinator:
    def __init__(self, end: CoordinatorEnd, log: CommitLog, *, timeout_s: float = 300.0, key: bytes | None = None):
        """`key`: the shared HMAC key; control messages are then signed and replies checked."""
        self.end, self.log, self.timeout_s, self.key = end, log, timeout_s, key
        self.version = self.log.latest()
        self.times: dict[str, float] = {}  # seconds of the last transfer's phases (for metrics)
        self.finished_everywhere: list[str] = []
        self.redo: set[str] = set()  # payloads a receiver finished but read back wrong: the next attempt re-sends them
        # After `begin`: receivers that refused because they do not hold the base (its digest
        # or version), with their per-tensor digests where they know them.
        self.resync_needed: dict[str, dict[str, str] | None] = {}
        # This coordinator's session (control_auth): receivers let each message act once, in
        # order, and refuse those of sessions that started before it.
        self.session, self.session_start, self.seq = uuid.uuid4().hex, time.time(), 0
        self._sending = threading.Lock()  # counters leave in the order they are given
        self._begun: tuple[str, int] | None = None  # (transfer id, counter) of the last begin: what 'applied' answers

    def new_transfer(self, producers: list[str], *, readback: bool = False, base_digest: str = "") -> TransferInfo:
        tid = f"v{self.version}-v{self.version + 1}-{uuid.uuid4().hex[:8]}"
        return TransferInfo(tid, self.version, self.version + 1, tuple(producers), readback=readback,
                            base_digest=base_digest)

    def new_resync(self, producers: list[str], base_digest: str) -> TransferInfo:
        """A dense resync of the committed version: every element, as overwrites, for the
        receivers that do not hold it (the others take none of it)."""
        tid = f"v{self.version}-resync-{uuid.uuid4().hex[:8]}"
        return TransferInfo(tid, self.version, self.version, tuple(producers), base_digest=base_digest, resync=True)

    def begin(self, info: TransferInfo) -> list[str]:
        """Announce the transfer (or its next attempt); returns problems (empty when
        every receiver is ready). Afterwards `finished_everywhere` holds the payload ids
        every receiver reported finished in earlier attempts (they need not travel again)."""
        t = time.perf_counter()
        self.times = {}
        self.finished_everywhere: list[str] = []
        self.resync_needed = {}
        redo, self.redo = sorted(self.redo) if info.attempt else [], set()
        try:
            seq = self._broadcast("begin", {"transfer_id": info.transfer_id, "transfer": info.to_json(), "redo": redo})
            self._begun = (info.transfer_id, seq)
            replies, problems = self._collect("ready", info.transfer_id, seq)
        except TransportError as e:
            return [str(e)]
        finally:
            self.times["prepare"] = time.perf_counter() - t
        problems += [f"{r}: {m['error']}" for r, m in sorted(replies.items()) if m.get("error")]
        self.resync_needed = {r: m.get("state_digest") for r, m in sorted(replies.items())
                              if m.get("error") and m.get("resync")}
        if not problems and replies:
            done = [set(m.get("finished") or ()) for m in replies.values()]
            self.finished_everywhere = sorted(set.intersection(*done))
        return problems

    def announce_catalog(self, specs: dict) -> None:
        """Tell receivers that build their runtime from the producers' tensors (a canonical
        mirror) what those are: name -> (dtype, shape). Sent before a transfer begins;
        receivers with a runtime of their own ignore it."""
        catalog = {name: [dtype, [int(s) for s in shape]] for name, (dtype, shape) in specs.items()}
        self._broadcast("catalog", {"catalog": catalog, "version": self.version})

    def _broadcast(self, kind: str, meta: dict) -> int:
        """Send `meta`, placed in this session (signed with it); returns its counter."""
        with self._sending:
            self.seq += 1
            place = {"session": self.session, "session_start": self.session_start, "seq": self.seq,
                     "issued_at": time.time()}
            self.end.broadcast(kind, sign(self.key, kind, {**meta, **place}))
            return self.seq

    def _collect(self, kind: str, transfer_id: str, seq: int | None) -> tuple[dict[str, dict], list[str]]:
        """Replies whose MAC (with a key) checks out and that answer request `seq` of this
        session, and a problem for each one that does not."""
        replies = self.end.collect(kind, transfer_id, self.timeout_s)
        good, problems = {}, []
        for rx, msg in sorted(replies.items()):
            why = check(self.key, kind, msg)
            if why is None and self.key is not None and msg.get("receiver") != rx:
                why = f"signed by {msg.get('receiver')!r}, delivered as {rx!r}"
            if why is None and self.key is not None and (msg.get("session"), msg.get("seq")) != (self.session, seq):
                why = (f"its '{kind}' answers message {msg.get('seq')} of session {msg.get('session')}, not "
                       f"{seq} of {self.session} (replayed, or late)")
            if why is None:
                good[rx] = msg
            else:
                problems.append(f"{rx}: {why}")
        return good, problems

    def finish(self, info: TransferInfo, producer_problems: list[str],
               payload_ids: list[str] | None = None, *, final: bool = True,
               readback: dict[str, dict[str, str]] | None = None, target_digest: str | None = None,
               payload_digests: dict[str, str] | None = None) -> Decision:
        """Wait for every receiver's apply, then commit jointly, or fail: abort everywhere
        when `final`, else leave receivers as they are for the next attempt (`info.retry()`).

        `payload_ids`: every payload of the transfer (over all its attempts); each receiver
        must report having finished exactly these (end to end, whatever the manifests said
        on the way). `readback` (when `info.readback`): every payload's expected post-apply
        digest per tensor; each receiver's read-back must match it. `target_digest`: the
        producers' whole-state digest of the target version, which every receiver that
        keeps one must hold after its apply (`payload_digests`, how each payload moves it,
        names the payloads to re-send when one does not). A resync (`info.resync`) writes
        no commit record: the version stays, the receivers that took it serve it again."""
        reasons = list(producer_problems)
        replies: dict[str, dict] = {}
        t = time.perf_counter()
        if not reasons:
            try:
                begun = self._begun[1] if self._begun and self._begun[0] == info.transfer_id else None
                replies, problems = self._collect("applied", info.transfer_id, begun)
                reasons += problems + [f"{r}: {m['error']}" for r, m in sorted(replies.items()) if m.get("error")]
            except TransportError as e:
                reasons.append(str(e))
        if not reasons and payload_ids is not None:
            want = payload_set_digest(payload_ids)
            reasons += [f"{r}: applied other payloads than the producers sent ({m.get('payloads')} != {want})"
                        for r, m in sorted(replies.items()) if m.get("payloads") != want and not m.get("skipped")]
        if not reasons and target_digest:
            for rx, m in sorted(replies.items()):
                why, wrong = state_mismatch(info, target_digest, payload_digests or {}, m)
                if why:
                    reasons.append(f"{rx}: {why}")
                    self.redo.update(wrong)
        if not reasons and info.readback and readback is not None:
            for rx, m in sorted(replies.items()):
                why, wrong = readback_mismatch(readback, m)
                if why:
                    reasons.append(f"{rx}: {why}")
                    self.redo.update(wrong)
        self.times["wait_applied"] = time.perf_counter() - t
        t = time.perf_counter()
        if not reasons and not info.resync:
            try:
                self.log.write(info, {"receivers": sorted(replies), "state_digest": target_digest or None})
            except AlreadyCommitted:
                reasons.append(f"version {info.target_version} was already committed by another coordinator")
            except TransportError as e:
                # The write may have landed before the error: the log itself says whether it did.
                if not self._committed_anyway(info):
                    reasons.append(f"writing the commit record of version {info.target_version} failed: {e}")
        if reasons:
            if final:
                self.abort(info, "; ".join(reasons))
            return Decision(info.transfer_id, False, self.version, reasons, replies)
        self.version = info.target_version
        self._broadcast("commit", {"transfer_id": info.transfer_id, "version": self.version})
        self.times["commit"] = time.perf_counter() - t
        return Decision(info.transfer_id, True, self.version, [], replies)

    def _committed_anyway(self, info: TransferInfo) -> bool:
        try:
            return self.log.latest() >= info.target_version
        except TransportError as e:
            raise TransportError(f"the commit record of version {info.target_version} may or may not have been "
                                 f"written, and the commit log cannot be read to tell ({e}): stop, and restart "
                                 f"the trainer once the log is reachable (it resumes from what the log says)") from e

    def abort(self, info: TransferInfo, reason: str) -> None:
        try:
            self._broadcast("abort", {"transfer_id": info.transfer_id, "reason": reason})
        except TransportError:
            pass  # an unreachable receiver reverts on its next begin (see Receiver._on_begin)

    def verify(self, dump_dir: str | None = None) -> dict[str, dict]:
        """Every receiver's serving version and per-tensor digests (and, with
        `dump_dir`, its full state written there as <receiver>.safetensors)."""
        tag = f"verify-{uuid.uuid4().hex[:8]}"
        seq = self._broadcast("verify", {"transfer_id": tag, "dump_dir": dump_dir})
        replies, problems = self._collect("verified", tag, seq)
        for problem in problems:  # an unverifiable reply proves nothing: report it as such
            rx = problem.split(":", 1)[0]
            replies[rx] = {"receiver": rx, "version": None, "digests": {}, "error": problem}
        return replies

    def shutdown(self) -> None:
        """Stop every receiver (each takes this message once: control_auth)."""
        self._broadcast("shutdown", {})


def readback_mismatch(expected: dict[str, dict[str, str]], reply: dict) -> tuple[str | None, list[str]]:
    """Why a receiver's read-back does not prove it holds the expected bits (None if it
    does), and the payloads found wrong (to be re-sent by the next attempt)."""
    scope, got = reply.get("readback_scope"), reply.get("readback")
    if scope == "none":
        return None, []  # a runtime holding parts of tensors cannot read back whole records (documented)
    if not isinstance(got, dict):
        return "sent no read-back digests", []
    wrong, why = [], None
    for pid, tensors in sorted(expected.items()):
        have = got.get(pid)
        if not isinstance(have, dict):
            why = why or f"read back nothing of payload {pid}"
        elif scope == "all" and set(have) != set(tensors):
            why = why or f"read back tensors {sorted(have)[:3]} of payload {pid}, expected {sorted(tensors)[:3]}"
        elif bad := sorted(n for n in have if tensors.get(n) != have[n]):
            why = why or f"read-back of payload {pid} differs from the producers' bits in {bad[:3]}"
        else:
            continue
        wrong.append(pid)
    return why, wrong


def state_mismatch(info: TransferInfo, target: str, payload_digests: dict[str, str],
                   reply: dict) -> tuple[str | None, list[str]]:
    """Why a receiver's whole-state digest after its apply does not prove it holds the
    target version (None if it does, or if the receiver keeps no digest: a runtime holding
    parts of tensors), and the payloads whose move of it differs from the producers'."""
    if reply.get("skipped") or reply.get("digest_scope", "all") == "none":
        return None, []
    got = reply.get("state_digest")
    if got == target:
        return None, []
    version = f"version {info.target_version}" + (" (resync)" if info.resync else "")
    if got is None:
        return f"cannot prove it holds {version}: its state digest is unknown", []
    moved = reply.get("payload_digests") or {}
    wrong = sorted(p for p, d in payload_digests.items() if p in moved and moved[p] != d)
    return (f"holds state digest {got} after applying, the producers' {version} is {target}"
            + (f"; payloads that moved it differently: {wrong[:3]}" if wrong else ""), wrong)
