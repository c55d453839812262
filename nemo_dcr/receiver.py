"""Receiver side: validate -> stage -> apply in place -> reply, and the joint commit.

Every payload of a transfer is decoded and validated (checksum, HMAC, versions,
names, shapes, positions) as it arrives and staged in memory; nothing is written
until every producer's manifest is in and every listed payload is staged. Only
then does the runtime adapter apply the records in place (the pause), one payload
per `apply` call, under an apply journal: a payload is "started" before its call and
"finished" (with its undo log) after it.

A transfer v -> v+1 may take several attempts (`TransferInfo.attempt`, one lineage).
The journal outlives a failed attempt: on a retry the receiver reports what it finished
and what is uncertain (started, not finished), drops re-sent payloads it finished (by
identity), and accepts only overwrites for uncertain ones, so no delta is ever applied
twice and the bits converge to v+1. A transfer given up on (abort, or a new lineage)
is undone from the undo logs, newest first; if a payload was uncertain the bits cannot
be known, so the receiver refuses further transfers until it is caught up from an
anchor (`nemo_dcr.catchup`). Payloads are deduplicated by identity.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from nemo_dcr.catchup import catch_up
from nemo_dcr.commit_log import payload_set_digest
from nemo_dcr.control_auth import ReplayGuard, answering, check, sign
from nemo_dcr.digest import StateDigest
from nemo_dcr.errors import ApplyError, DCRError, KeyMismatch, PayloadRejected, TransportError
from nemo_dcr.history import open_history
from nemo_dcr.metrics import page_faults
from nemo_dcr.mirror import CanonicalMirror
from nemo_dcr.records import Op, Payload, TransferInfo
from nemo_dcr.runtimes.base import RuntimeAdapter, UndoLog
from nemo_dcr.runtimes.scatter import resolve_threads
from nemo_dcr.transport import ReceiverEnd
from nemo_dcr.verify import read_back, state_digests
from nemo_dcr.wire import codec


@dataclass
class _Lineage:
    """One v -> v+1 transfer across its attempts, and its apply journal."""

    id: str
    base: int
    target: int
    started: set[str] = field(default_factory=set)  # payload ids whose apply began
    finished: dict[str, UndoLog] = field(default_factory=dict)  # ... and completed (in order), with undo logs
    complete: bool = False  # every listed payload finished and 'applied' was answered without error
    readback: dict[str, dict[str, str]] = field(default_factory=dict)  # payload id -> tensor -> post-apply digest
    moved: dict[str, str | None] = field(default_factory=dict)  # payload id -> how its apply moved the state digest
    resync: bool = False  # a dense resync of the base version (it ends where it started: base == target)

    @property
    def uncertain(self) -> list[str]:
        return sorted(self.started - set(self.finished))


@dataclass
class _Transfer:
    """One attempt of a lineage."""

    info: TransferInfo
    request: dict = field(default_factory=dict)  # the begin's session and counter, which 'applied' answers
    skip: bool = False  # a resync this receiver does not need: its payloads are acknowledged, not decoded
    staged: dict[str, Payload] = field(default_factory=dict)
    staged_bytes: int = 0
    manifests: dict[str, list[str]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    dropped: int = 0  # re-sent payloads already finished (dropped by identity)
    applied: bool = False
    replied: bool = False
    applied_payloads: str | None = None  # digest of the lineage's finished payload ids (see payload_set_digest)
    readback_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    stage_s: float = 0.0
    apply_s: float = 0.0
    faults_at_start: int = field(default_factory=page_faults)
    cpu_at_start: float = field(default_factory=time.process_time)  # the whole process's (serving included)


class Receiver:
    def __init__(
        self,
        receiver_id: str,
        runtime: RuntimeAdapter,
        end: ReceiverEnd,
        *,
        version: int = 0,
        key: bytes | None = None,
        limits: codec.DecodeLimits | None = None,
        max_staged_bytes: int = 8 << 30,
        log=None,
        canonical_catalog: dict | None = None,
        history=None,
        rescan: bool = False,
        state_digest: bool = True,
        key_mismatch_exit_s: float | None = 60.0,
        mirror: CanonicalMirror | None = None,
        decode_threads: int | None = None,
    ):
        """`history` (a `nemo_dcr.history.History` or a directory): where to catch up from
        when a transfer starts from a version this receiver does not serve, when its bits
        are uncertain, or when its state digest is not the producers'; without one such a
        transfer is refused, naming the reason, and the producers resync it densely.

        The whole-state digest (`nemo_dcr.digest`) is read from the runtime once here,
        O(model), then kept up to date by every apply and revert. `rescan`: read it from
        the runtime again at every begin (O(model) before anything is written), so that
        bits changed outside refits (memory corruption, a foreign write) are caught there
        too; `rescan()` does the same on demand (e.g. from an idle serving loop).
        `state_digest=False` keeps none: no proof of the base at begin nor of the state
        before the commit (the producers' digests are then not checked here).

        `key_mismatch_exit_s`: a receiver whose key is not its producers' cannot
        authenticate their shutdown either. When control messages keep arriving and none
        has ever authenticated, `serve_forever` raises `KeyMismatch` this many seconds
        after the first rejected one (None: keep serving).

        `mirror`: the canonical host mirror (`nemo_dcr.mirror`) that baseline-conditioned
        records decode against where the runtime does not hold its tensors in canonical
        layout (vLLM); it must hold this receiver's version of every tensor it serves, and
        every apply and revert moves it too. Without one such a runtime rejects conditioned
        records, naming the tensor.

        `decode_threads`: a payload's records are decoded on up to this many threads when
        it is staged (None: the cores this process may use). Several receivers on one host
        (one per GPU) share its cores: give each its part."""
        self.id, self.runtime, self.end = receiver_id, runtime, end
        self.mirror = mirror
        self.baselines = CommittedBits(runtime, mirror)  # what conditioned records decode against
        self.serving_version = version
        self.key, self.limits = key, limits or codec.DecodeLimits()
        self.max_staged_bytes = max_staged_bytes
        self.decode_threads = resolve_threads(decode_threads, "decode_threads", cap=None)
        # A runtime may hold a subset of the model (one Megatron-inference rank): payloads
        # are validated against the whole `canonical_catalog` (names outside it are still
        # rejected) and only records of tensors in `runtime.catalog()` (`held`) are applied.
        self.held = runtime.catalog()
        self.catalog = self.held if canonical_catalog is None else _superset(canonical_catalog, self.held)
        self.current: _Transfer | None = None
        self.lineage: _Lineage | None = None
        # Read-back verification: "all" tensors, only the "held" ones (a subset receiver), or
        # "none" where the runtime holds parts of tensors (a TP shard): positions outside it
        # would not read back.
        self.readback_scope = ("none" if not getattr(runtime, "full_coverage", True)
                               else "all" if self.held == self.catalog else "held")
        self.uncertain_state: str | None = None  # why the bits are unknown (refuses transfers until caught up)
        self.log = log or (lambda msg: None)
        self.history = open_history(history)
        self._stopping = threading.Event()
        # The whole-state digest covers receivers that hold every canonical element; one that
        # holds parts of tensors or a subset of them cannot be compared with the producers'.
        self.digest_scope = "all" if self.readback_scope == "all" and state_digest else "none"
        if hasattr(runtime, "track_digest"):
            runtime.track_digest = self.digest_scope == "all"
        self.rescan_at_begin = rescan
        self.digest_load_s = 0.0
        self.state: StateDigest | None = None  # None: unknown (or outside the digest's scope)
        if self.digest_scope == "all":
            self.rescan()
        self.resyncs = 0  # dense resyncs this receiver took
        self.guard = ReplayGuard()  # the coordinator's session heard here: a replayed message acts no more
        self.refused: str | None = None  # why the last control message handled was refused (None: it acted)
        self.key_mismatch_exit_s = key_mismatch_exit_s
        self._authenticated = False  # a control message has authenticated: the key is the producers'
        self._first_rejected: float | None = None  # when the first control message failed authentication

    # --- the whole-state digest -------------------------------------------------------

    @property
    def state_digest(self) -> str | None:
        """The digest of what this receiver holds (32 hex digits), or None when unknown."""
        return self.state.hex() if self.state is not None else None

    def rescan(self) -> bool:
        """Read the whole-state digest from the runtime anew (O(model)); False when it
        differs from the one kept up to date by the applies (the bits changed outside
        them: memory corruption, a foreign write), which is logged."""
        t = time.perf_counter()
        fresh = self.runtime.state_digest()
        self.digest_load_s = time.perf_counter() - t
        same = self.state is None or fresh is None or fresh == self.state
        if not same:
            self.log(f"[{self.id}] the bits changed outside refits: state digest {self.state.hex()} kept, "
                     f"{fresh.hex()} read back (tensors {self.state.differing(fresh, 3)})")
        self.state = fresh
        return same

    def apply_records(self, records) -> UndoLog:
        """`runtime.apply`, with the state digest moved by what it wrote."""
        undo = self.runtime.apply(records)
        if self.mirror is not None:
            undo.mirror = self.mirror.apply(records)
        self._account(undo, 1)
        return undo

    def revert(self, undo: UndoLog) -> None:
        """`runtime.revert`, with the state digest moved back."""
        self.runtime.revert(undo)
        if self.mirror is not None:
            self.mirror.revert(undo.mirror)
        self._account(undo, -1)

    def _account(self, undo: UndoLog, sign: int) -> None:
        if self.state is not None:
            if undo.digest is None:
                self.state = None  # the adapter cannot tell how its writes moved it
            else:
                self.state.merge(undo.digest, sign)

    def _base_problem(self, info: TransferInfo) -> str | None:
        """Why this receiver does not hold the transfer's base, by its state digest (None
        when it does, or when the transfer or this receiver carries no digest)."""
        if self.digest_scope != "all" or not info.base_digest:
            return None
        if self.rescan_at_begin:
            self.rescan()
        mine = self.state_digest
        if mine == info.base_digest:
            return None
        return (f"receiver {self.id} does not hold version {info.base_version}: its state digest is "
                f"{mine or 'unknown'}, the producers' is {info.base_digest}")

    def catch_up(self, target: int | None = None):
        """Take this receiver to `target` (default: the newest version in its history);
        call it before `serve_forever` or from the receiver's own thread."""
        if self.history is None:
            raise ValueError(f"receiver {self.id} has no history to catch up from")
        report = catch_up(self, self.history, target=target)
        if self.state is None and self.digest_scope == "all" and report.anchor is not None:
            self.rescan()  # an anchor overwrote every element: the bits are a known version again
        return report

    # --- event loop -----------------------------------------------------------------

    def serve_forever(self, poll_s: float = 0.5) -> None:
        """Handle events until a (valid) shutdown message or `stop()`."""
        while not self._stopping.is_set():
            try:
                event = self.end.poll(poll_s)
            except TransportError as e:  # an outage of the transport: keep serving, try again
                self.log(f"[{self.id}] transport: {e}")
                time.sleep(poll_s)
                continue
            if event is not None and not self.handle(event):
                return
            self._check_key_mismatch()

    def _check_key_mismatch(self) -> None:
        if self._authenticated or self._first_rejected is None or self.key_mismatch_exit_s is None:
            return
        waited = time.monotonic() - self._first_rejected
        if waited >= self.key_mismatch_exit_s:
            raise KeyMismatch(f"receiver {self.id}: no control message authenticated in {waited:.0f} s of "
                              "rejected ones, so this receiver's HMAC key is not its producers' (or they sign "
                              "nothing) and their shutdown cannot reach it: it stops here. Start it with the "
                              "trainer's key (the same key_env on both sides)")

    def stop(self) -> None:
        """Make `serve_forever` return within one poll, from another thread of the hosting
        process (a shutdown message it could not authenticate would not stop it)."""
        self._stopping.set()

    def handle(self, event) -> bool:
        """Process one event; False once asked to shut down."""
        kind, meta = event.kind, event.meta
        try:
            # payloads carry their own HMAC; manifests are checked end to end
            self.refused = None if kind in ("payload", "manifest") else self._refusal(kind, meta)
            if self.refused is not None:
                return True
            if kind == "payload":
                self._on_payload(event)
            elif kind == "begin":
                self._on_begin(TransferInfo.from_json(meta["transfer"]), meta.get("redo") or [], meta)
            elif kind == "manifest":
                self._on_manifest(meta)
            elif kind == "commit":
                self._on_commit(meta)
            elif kind == "abort":
                self._on_abort(meta)
            elif kind == "verify":
                self._on_verify(meta)
            elif kind == "shutdown":
                return False
        finally:
            event.release()
        return True

    def _refusal(self, kind: str, meta: dict) -> str | None:
        """Why a control message must not act (None when it may): it fails authentication,
        or it was heard before or belongs to an older session (`ReplayGuard`). Logged; a
        refused begin is answered with the reason, unless it replays one of the current
        session (whose coordinator has this receiver's answer already)."""
        why = check(self.key, kind, meta)
        if why is not None:
            self._rejected(kind, why)
            answer = True
        else:
            self._authenticated = True
            current = self.guard.session
            why = None if self.key is None else self.guard.problem(kind, meta, time.time())
            if why is None:
                return None
            self.log(f"[{self.id}] ignored a '{kind}' control message: {why}")
            answer = meta.get("session") != current
        if answer and kind == "begin" and isinstance(meta.get("transfer_id"), str):
            self._reply("ready", {"transfer_id": meta["transfer_id"],
                                  "error": f"receiver {self.id} refused the begin: {why}"}, meta)
        return why

    def _rejected(self, kind: str, why: str) -> None:
        """Log a control message that failed authentication (the first with what it means)."""
        self.log(f"[{self.id}] ignored a '{kind}' control message: {why}")
        if self._first_rejected is None and not self._authenticated:
            self._first_rejected = time.monotonic()
            limit = ("" if self.key_mismatch_exit_s is None else
                     f"; unless one authenticates, it stops in {self.key_mismatch_exit_s:.0f} s")
            self.log(f"[{self.id}] if this receiver's HMAC key is not the trainer's, no refit and no shutdown "
                     f"can reach it{limit}")

    # --- handlers -------------------------------------------------------------------

    def _on_begin(self, info: TransferInfo, redo: list[str] = (), request: dict | None = None) -> None:
        """`redo`: payloads read back wrong somewhere: finished here, they count as uncertain.
        `request`: the begin message (its session and counter are echoed in the replies)."""
        request = answering(request or {})
        self.current = None
        if info.resync:
            return self._on_resync(info, request)
        lin = self.lineage
        if lin is not None and lin.complete and info.base_version == lin.target:
            # A coordinator starts from v+1 only once v+1 is committed: this receiver
            # applied all of it and missed the commit message.
            self._committed(lin)
            lin = None
        elif lin is not None and (lin.id, lin.base, lin.target) != (info.lineage_id, info.base_version,
                                                                     info.target_version):
            self._unwind(f"superseded by transfer {info.transfer_id}")
            lin = None
        error = self._ready_for(info) if lin is None else None
        if error:
            # A receiver that does not hold the base asks the producers for a dense resync.
            self._reply("ready", {"transfer_id": info.transfer_id, "error": error, "resync": True,
                                  "state_digest": self.state.to_json() if self.state is not None else None}, request)
            return
        if lin is None:
            lin = self.lineage = _Lineage(info.lineage_id, info.base_version, info.target_version)
        redone = [pid for pid in redo if lin.finished.pop(pid, None) is not None]
        for pid in redone:
            lin.readback.pop(pid, None)
        if redone and self.digest_scope == "all":
            self.rescan()  # its bits were found not to be what it applied: its digest is read back too
        lin.complete = False
        self.current = _Transfer(info, request)
        self._reply("ready", {"transfer_id": info.transfer_id, "error": None,
                              "finished": sorted(lin.finished), "uncertain": lin.uncertain}, request)

    def _ready_for(self, info: TransferInfo) -> str | None:
        """Why a new lineage cannot start here (None when it can), after catching up
        from the history where that helps."""
        if self.history is not None and (self.uncertain_state or info.base_version > self.serving_version):
            problem = self._catch_up_for(info)
            if problem:
                return problem
        if self.uncertain_state:
            return f"receiver {self.id} cannot take transfers: {self.uncertain_state}"
        if info.base_version != self.serving_version:
            return f"receiver {self.id} serves version {self.serving_version}, transfer starts from {info.base_version}"
        problem = self._base_problem(info)
        if problem and self.history is not None:  # its bits are not the version it serves: from an anchor
            self.log(f"[{self.id}] {problem}; catching up from an anchor")
            self.uncertain_state = problem
            problem = self._catch_up_for(info) or self._base_problem(info)
        return problem

    def _catch_up_for(self, info: TransferInfo) -> str | None:
        try:
            self.catch_up(info.base_version)
        except (DCRError, OSError) as e:
            self.log(f"[{self.id}] catch-up to version {info.base_version} failed: {e}")
            return f"receiver {self.id} could not catch up to version {info.base_version}: {e}"
        return None

    def _on_resync(self, info: TransferInfo, request: dict) -> None:
        """A dense resync of version `info.base_version`: taken when this receiver does not
        hold it (its digest, version or bits say so), acknowledged without decoding otherwise."""
        lin = self.lineage
        if lin is not None and lin.complete and info.base_version == lin.target:
            self._committed(lin)  # applied whole, and only the commit message was missed
        elif lin is not None:
            self._unwind(f"superseded by resync {info.transfer_id}")
        need = (self.uncertain_state or (info.base_version != self.serving_version and "another version")
                or (self.digest_scope == "all" and self.state_digest != info.base_digest and "another digest"))
        self.current = _Transfer(info, request, skip=not need)
        if need:
            self.lineage = _Lineage(info.lineage_id, info.base_version, info.target_version, resync=True)
            self.log(f"[{self.id}] taking resync {info.transfer_id} of version {info.base_version} ({need})")
        self._reply("ready", {"transfer_id": info.transfer_id, "error": None, "skip": not need,
                              "finished": [], "uncertain": []}, request)

    def _reply(self, kind: str, meta: dict, request: dict) -> None:
        """Answer `request` (a coordinator message): its session and counter go along, signed."""
        self.end.reply(kind, sign(self.key, kind, {**meta, **answering(request), "receiver": self.id}))

    def _on_payload(self, event) -> None:
        meta = event.meta
        tid, pid, producer = meta.get("transfer_id"), meta.get("payload_id"), meta.get("producer_id")
        cur, lin = self.current, self.lineage
        if cur is None or cur.info.transfer_id != tid:
            self.end.staged(tid, producer, pid, f"receiver {self.id} has no open transfer {tid}")
            return
        if cur.skip:  # a resync this receiver does not need
            self.end.staged(tid, producer, pid, None)
            return self._maybe_apply()
        if pid in cur.staged or pid in lin.finished:
            cur.dropped += pid in lin.finished
            self.end.staged(tid, producer, pid, None)  # duplicate, or finished in an earlier attempt
            return
        t = time.perf_counter()
        error = meta.get("error")
        if error is None and event.data is None:
            error = "payload bytes missing"
        if error is None:
            try:
                if len(event.data) + cur.staged_bytes > self.max_staged_bytes:
                    raise PayloadRejected(pid, f"staging it would exceed max_staged_bytes={self.max_staged_bytes}")
                info = cur.info
                data = event.data
                if getattr(data, "is_cuda", False):
                    data = data.cpu().numpy()  # device payload (CUDA IPC); the decoder runs on the host
                payload = codec.decode(
                    data, key=self.key, catalog=self.catalog, limits=self.limits,
                    expected=codec.Expected(info.transfer_id, info.base_version, info.target_version),
                    baselines=self.baselines, held=self.held, threads=self.decode_threads,
                )
                if payload.header.payload_id != pid or payload.header.producer_id != producer:
                    raise PayloadRejected(pid, f"header names payload {payload.header.payload_id} "
                                               f"of producer {payload.header.producer_id}")
                if producer not in info.producers:
                    raise PayloadRejected(pid, f"producer {producer} is not part of transfer {tid}")
                if pid in lin.started and any(Op(r.op) is not Op.OVERWRITE for r in payload.records):
                    raise PayloadRejected(pid, "it was half-applied by an earlier attempt: only overwrites "
                                               "can repair it, a delta would be applied twice")
                cur.staged[pid] = payload
                cur.staged_bytes += len(event.data)
            except PayloadRejected as e:
                error = e.reason
        cur.stage_s += time.perf_counter() - t
        if error is not None:
            error = f"payload {pid} from {producer} rejected: {error}"
            cur.errors.append(error)
            self.log(f"[{self.id}] {error}")
        self.end.staged(tid, producer, pid, error)
        self._maybe_apply()

    def _on_manifest(self, meta: dict) -> None:
        cur = self.current
        if cur is None or cur.info.transfer_id != meta.get("transfer_id"):
            return
        cur.manifests[meta["producer_id"]] = list(meta["payload_ids"])
        self._maybe_apply()

    def _maybe_apply(self) -> None:
        cur, lin = self.current, self.lineage
        if cur is None or cur.replied or set(cur.manifests) != set(cur.info.producers):
            return
        if cur.skip:
            cur.applied = True
            return self._reply_applied(cur, None)
        listed = {pid for ids in cur.manifests.values() for pid in ids}
        if cur.errors:
            return self._reply_applied(cur, "; ".join(cur.errors[:3]))
        todo = sorted(listed - set(lin.finished))
        if not set(todo) <= set(cur.staged):
            return  # some listed payloads have not arrived yet
        unlisted = set(cur.staged) - listed
        if unlisted:
            return self._reply_applied(cur, f"payloads not in any manifest: {sorted(unlisted)[:3]}")
        t = time.perf_counter()
        applied = []
        failed = None
        try:
            with self.runtime.batch():  # the pause: nothing else touches the runtime until it ends
                for pid in todo:  # journal: started -> apply (all or nothing per call) -> finished
                    records = [rec for rec in cur.staged.pop(pid).records if rec.name in self.held]
                    lin.started.add(pid)
                    try:
                        undo = self.apply_records(records)
                    except Exception as e:  # noqa: BLE001 - the adapter decides what its failure left behind
                        if isinstance(e, ApplyError) and not e.bits_unknown:
                            lin.started.discard(pid)  # the adapter put every bit back: not applied, not uncertain
                        elif self.digest_scope == "all":
                            self.rescan()  # what it left behind, read back: the retry's overwrites move on from it
                        failed = f"apply failed (payload {pid}): {type(e).__name__}: {e}"
                        break
                    lin.finished[pid] = undo  # the undo log keeps what revert needs
                    lin.moved[pid] = undo.digest.hex() if undo.digest is not None else None
                    applied.append((pid, records))
        except Exception as e:  # noqa: BLE001 - the batch's finishing work (post-load processing) failed
            failed = f"apply failed at the end of the batch: {type(e).__name__}: {e}"
            self._revert_batch(lin, [pid for pid, _ in applied])
        finally:
            cur.apply_s = time.perf_counter() - t
        if failed:
            return self._reply_applied(cur, failed)
        if cur.info.readback and self.readback_scope != "none":
            # After the pause, one read of the runtime's state: payloads touch disjoint positions,
            # so each one's regions read back now as they were right after its apply.
            t = time.perf_counter()
            state = self.runtime.canonical_state()
            for pid, records in applied:
                lin.readback[pid] = read_back(state, records)
            cur.readback_s = time.perf_counter() - t
        cur.applied = True
        cur.applied_payloads = payload_set_digest(lin.finished)
        self._reply_applied(cur, None)
        lin.complete = True

    def _revert_batch(self, lin: _Lineage, pids: list[str]) -> None:
        """Undo the payloads one batch applied (newest first): its finishing step failed."""
        for pid in reversed(pids):
            undo = lin.finished.pop(pid)
            lin.moved.pop(pid, None)
            try:
                self.revert(undo)
            except Exception as e:  # noqa: BLE001 - the bits are unknown now, whatever raised
                self.uncertain_state = f"reverting payload {pid} after a failed batch failed ({type(e).__name__}: {e})"
                return
            lin.started.discard(pid)

    def _reply_applied(self, cur: _Transfer, error: str | None) -> None:
        cur.replied = True
        lin = self.lineage
        self._reply("applied", {
            "transfer_id": cur.info.transfer_id, "error": error, "skipped": cur.skip,
            "digest_scope": self.digest_scope, "state_digest": self.state_digest,
            "payload_digests": dict(lin.moved) if lin is not None and not cur.skip else {},
            "stage_s": cur.stage_s,
            "apply_s": cur.apply_s, "total_s": time.perf_counter() - cur.started, "payloads": cur.applied_payloads,
            "dropped": cur.dropped, "page_faults": page_faults() - cur.faults_at_start,
            "cpu_s": time.process_time() - cur.cpu_at_start,
            **({"readback": self.lineage.readback if self.lineage else {}, "readback_scope": self.readback_scope,
                "readback_s": cur.readback_s} if cur.info.readback else {}),
        }, cur.request)

    def _on_commit(self, meta: dict) -> None:
        cur = self.current
        if cur is None or cur.info.transfer_id != meta.get("transfer_id") or not cur.applied:
            self.log(f"[{self.id}] ignoring commit of {meta.get('transfer_id')}: not applied here")
            return
        self._committed(self.lineage)

    def _committed(self, lin: _Lineage | None) -> None:
        if lin is not None:  # None: a resync this receiver did not need
            self.serving_version = lin.target
            if lin.resync:
                self.uncertain_state = None  # every element overwritten, and its digest checked
                self.resyncs += 1
        self.lineage = self.current = None

    def _on_abort(self, meta: dict) -> None:
        cur = self.current
        if cur is None or cur.info.transfer_id != meta.get("transfer_id"):
            return
        self.log(f"[{self.id}] transfer {cur.info.transfer_id} aborted: {meta.get('reason')}")
        self._unwind(f"aborted: {meta.get('reason')}")

    def _unwind(self, why: str) -> None:
        """Undo the open lineage (newest payload first) and forget it; back at its base."""
        lin, self.current = self.lineage, None
        if lin is None:
            return
        try:
            for pid in reversed(list(lin.finished)):
                self.revert(lin.finished[pid])
        except Exception as e:  # noqa: BLE001 - the bits are unknown now, whatever raised
            self.uncertain_state = f"reverting transfer {lin.id} failed ({type(e).__name__}: {e})"
        self.lineage = None
        if lin.uncertain and not self.uncertain_state:
            self.uncertain_state = (f"payloads {lin.uncertain[:3]} of transfer {lin.id} were being applied when it "
                                    f"was given up ({why}); their bits are unknown: catch up from an anchor")
        if self.uncertain_state:
            self.log(f"[{self.id}] {self.uncertain_state}")

    def _on_verify(self, meta: dict) -> None:
        if self.digest_scope == "all":
            self.rescan()  # the state as read now, not as the applies kept it
        reply = {"transfer_id": meta.get("transfer_id", ""), "version": self.serving_version,
                 "digests": self.digests(), "state_digest": self.state_digest}
        if meta.get("dump_dir"):  # full bits for offline comparison (tests, debugging)
            from safetensors.torch import save_file

            path = os.path.join(meta["dump_dir"], f"{self.id}.safetensors")
            save_file({k: v.detach().contiguous().cpu() for k, v in self.runtime.canonical_state().items()}, path)
            reply["dump"] = path
        self._reply("verified", reply, meta)

    def digests(self) -> dict[str, str]:
        """XXH3-128 of every canonical tensor's stored bits (for end-state checks)."""
        return state_digests(self.runtime.canonical_state())


class CommittedBits:
    """The committed canonical bits a receiver decodes conditioned records against: the
    runtime's own where it holds them in canonical layout, else its canonical mirror."""

    def __init__(self, runtime: RuntimeAdapter, mirror: CanonicalMirror | None):
        self.runtime, self.mirror = runtime, mirror

    def bits(self, name: str, lo: int, hi: int) -> np.ndarray | None:
        found = self.runtime.committed_bits(name, lo, hi)
        if found is None and self.mirror is not None:
            found = self.mirror.bits(name, lo, hi)
        return found


def _superset(catalog: dict, held: dict) -> dict:
    """`catalog` (name -> (dtype, shape)), checked to contain every held entry as is."""
    full = {n: (d, tuple(int(x) for x in shape)) for n, (d, shape) in catalog.items()}
    for name, (dtype, shape) in held.items():
        if full.get(name) != (dtype, tuple(int(x) for x in shape)):
            raise ValueError(f"the runtime holds {name!r} as {dtype} {tuple(shape)}, but the canonical catalog "
                             f"has {full.get(name, 'no such tensor')}")
    return full
