"""Trainer-side orchestration of refits across the ranks of one training job.

Every rank is a producer for the ranges it owns; global rank 0 also runs the
coordinator. Ranks agree on the transfer and the commit decision through small
JSON messages over torch.distributed (uint8 tensors, never pickle). No rank ever
gathers parameters.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from nemo_dcr.baseline import Baseline, fingerprint
from nemo_dcr.commit import Coordinator, Decision
from nemo_dcr.commit_log import commit_log_for
from nemo_dcr.converter import Converter, check_exact_cover, coverage_runs
from nemo_dcr.digest import StateDigest, add_hex
from nemo_dcr.errors import ConverterError, TransferFailed
from nemo_dcr.history import ANCHORS, DELTAS, open_history
from nemo_dcr.layout import OwnedRange, ParallelLayout
from nemo_dcr.records import AUTO, Op, TransferInfo
from nemo_dcr.sender import Producer, ProducerReport
from nemo_dcr.transport import Transport
from nemo_dcr.wire.versions import FORMAT_VERSION


@dataclass
class RefitResult:
    decision: Decision
    transfer: TransferInfo
    producers: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    dense_bytes: int = 0
    coordinator_times: dict = field(default_factory=dict)  # prepare / wait_applied / commit (rank 0)
    failed_before: int = 0  # transfers that failed since the previous commit (this one recovered them)
    attempts: int = 1  # attempts this transfer took (the ones after the first were in-place retries)
    base_digest: str = ""  # the whole-state digest of the version the transfer started from
    resynced: list[str] = field(default_factory=list)  # receivers densely resynced before it (wrong base)
    resync_s: float = 0.0

    @property
    def scanned_elements(self) -> int:
        return sum(p["scanned_elements"] for p in self.producers)

    @property
    def changed_elements(self) -> int:
        return sum(p["changed_elements"] for p in self.producers)

    @property
    def residual_elements(self) -> int:
        return sum(p.get("residual_elements", 0) for p in self.producers)

    @property
    def wire_bytes(self) -> int:
        return sum(p["wire_bytes"] for p in self.producers)

    @property
    def state_digest(self) -> str:
        """The whole-state digest of the version served now (the target's when committed)."""
        if not self.decision.committed or not self.base_digest:
            return self.base_digest
        return add_hex(p["state_digest"] for p in self.producers)

    @property
    def change_rate(self) -> float:
        return self.changed_elements / max(self.scanned_elements, 1)

    def metrics(self) -> dict:
        """Flat numbers for a logger (NeMo RL's, or `nemo_dcr.metrics.PrometheusExporter`).

        Stage times are the slowest producer's / receiver's: capture is part of diff (the
        owned ranges are live views, read in place); transfer is send + flush; the pause
        is the receivers' in-place apply (decode and staging happen before it). With
        encode_threads, encode is the encoding threads' time (it overlaps the diff) and
        encode_wait the time the rank waited for them."""
        stage = lambda k: max((p["times"][k] for p in self.producers), default=0.0)  # noqa: E731
        applied = self.decision.receivers.values()
        transfer = max((p["times"]["send"] + p["times"]["flush"] for p in self.producers), default=0.0)
        return {
            "version": self.decision.version,
            "committed": self.decision.committed,
            "change_rate": self.change_rate,
            "changed_elements": self.changed_elements,
            "residual_changed_elements": self.residual_elements,
            "dense_bytes": self.dense_bytes,
            "wire_bytes": self.wire_bytes,
            "compression": self.dense_bytes / max(self.wire_bytes, 1),
            "refit_s": self.seconds,
            "payloads": sum(p["payloads"] for p in self.producers),
            **{f"producer_{k}_s": stage(k)
               for k in ("residual", "diff", "place", "encode", "encode_wait", "send", "flush")},
            "producer_transfer_s": transfer,
            # the most CPU time any producer's refit thread took (beside its stages' wall-clock times)
            "producer_cpu_s": max((p.get("cpu_s", 0.0) for p in self.producers), default=0.0),
            # ... and any receiver process's for the transfer, all its threads: decoding, relaying,
            # applying, and, where the receiver lives in a serving runtime's process, serving too
            "receiver_cpu_s": max((r.get("cpu_s", 0.0) for r in applied), default=0.0),
            "receiver_stage_s": max((r.get("stage_s", 0.0) for r in applied), default=0.0),
            "receiver_apply_s": max((r.get("apply_s", 0.0) for r in applied), default=0.0),
            "pause_s": max((r.get("apply_s", 0.0) for r in applied), default=0.0),
            "receivers": len(self.decision.receivers),
            # In-place retries of this transfer (overwrites of what was uncertain), and
            # transfers given up since the previous commit (aborted everywhere, the next
            # one taken against the committed version again).
            "retries": self.attempts - 1,
            "failed_transfers_before": self.failed_before,
            "recovered": self.attempts > 1 or self.failed_before > 0,
            "receiver_dropped_payloads": sum(r.get("dropped", 0) for r in applied),
            # first touches of memory during the refit (metrics.page_faults), the most of any process
            "producer_page_faults": max((p.get("page_faults", 0) for p in self.producers), default=0),
            "receiver_page_faults": max((r.get("page_faults", 0) for r in applied), default=0),
            "receiver_readback_s": max((r.get("readback_s", 0.0) for r in applied), default=0.0),
            "producer_digest_s": max((p["times"].get("digest", 0.0) for p in self.producers), default=0.0),
            # The proof of the refit (nemo_dcr.digest): every receiver that keeps a whole-state
            # digest held base_state_digest at begin and state_digest before the commit.
            "base_state_digest": self.base_digest,
            "state_digest": self.state_digest,
            "producer_state_digest_s": max((p["times"].get("state_digest", 0.0) for p in self.producers),
                                           default=0.0),
            "digest_checked_receivers": sum(1 for r in applied if r.get("digest_scope", "all") == "all"
                                            and r.get("state_digest")),
            "resynced_receivers": len(self.resynced),
            "resync_s": self.resync_s,
            **{f"coordinator_{k}_s": v for k, v in sorted(self.coordinator_times.items())},
        }


class TrainerRefit:
    """Set up once per training job (after the model holds the committed version).

    `params` (optional): this rank's whole local parameters by normalized name, read by
    the residual rules it produces; by default the owned ranges' live views reach them.

    Restarts: when the commit log already holds a version v > 0, the producers need v's
    bits as their baseline, not whatever weights the trainer restarted from. With
    `baseline_dir` (one subdirectory per rank, memory-mapped, journaled) they come back
    from disk; otherwise set-up refuses, unless `assume_committed=True` declares that the
    model holds exactly version v's weights (e.g. it was saved when v committed).

    `op`: how changes travel - "auto" (default: xor or add per tensor and payload,
    whichever codes smaller), xor, add or overwrite (sender.Producer).

    `max_attempts`: tries of one transfer before it is aborted (the retries are in place:
    what receivers finished stays, the rest is re-sent as overwrites). `log`: a callable
    taking one line, told about each failed attempt. `wire_version`: the wire format of
    the payloads and anchors (5, the host format; 6, the device format, experimental).
    `conditioned`: code records against the committed bits both ends hold where that is
    smaller (`nemo_dcr.wire.conditioned`); every receiver must read its committed canonical
    bits (in place, or from a `nemo_dcr.mirror.CanonicalMirror`). `device_payloads`
    (wire_version 6, the local transport, no key): payloads are sealed on the trainer's
    device and reach receivers by CUDA IPC (sender.Producer).

    `history` (a directory, "s3" for the s3 transport's bucket, or a `nemo_dcr.history.
    History`): after each commit the version's payloads are stored there as its delta,
    and every `anchor_every` versions (and at set-up when there is none) an anchor of the
    whole model, keeping the newest `keep_anchors`; receivers catch up from it
    (`nemo_dcr.catchup`). Storing happens after the commit and never fails a refit.

    `readback`: receivers read every applied region back through their runtime and the
    commit waits until each one's digests match what the producers sent (else the attempt
    fails and is retried with overwrites); costs are in the metrics (readback, digest).

    `state_digest` (default on): the producers keep the whole-state digest of their shares
    (`nemo_dcr.digest`); each transfer names the base's, which receivers check at begin
    (a receiver that does not hold it is resynced densely first), and the commit waits
    until every receiver holds the target's. Off: neither check (receivers that keep a
    digest then check nothing).
    """

    def __init__(
        self,
        converter: Converter,
        specs: dict,
        owned: list[OwnedRange],
        layout: ParallelLayout,
        transport: Transport,
        *,
        state_dir: str,
        op: Op | str = AUTO,
        key: bytes | None = None,
        max_payload_elements: int = 1 << 20,
        encode_threads: int = 0,
        wire_version: int = FORMAT_VERSION,
        conditioned: bool = False,
        device_payloads: bool = False,
        baseline_dir: str | None = None,
        timeout_s: float = 300.0,
        params: dict[str, torch.Tensor] | None = None,
        assume_committed: bool = False,
        max_attempts: int = 3,
        log=None,
        history=None,
        anchor_every: int = 0,
        keep_anchors: int = 2,
        readback: bool = False,
        state_digest: bool = True,
    ):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        ensure_process_group()
        if anchor_every < 0 or keep_anchors < 1:
            raise ValueError(f"anchor_every must be >= 0 and keep_anchors >= 1, got {anchor_every}, {keep_anchors}")
        self.max_attempts, self.readback = max_attempts, readback
        self.transfer: TransferInfo | None = None  # the latest attempt begun (what an abort must name)
        self.history = open_history(history, transport)
        self.anchor_every, self.keep_anchors, self.key = anchor_every, keep_anchors, key
        self.anchor_due = False  # a delta could not be stored: the next commit writes an anchor
        self.log = log or (lambda msg: None)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.failed_since_commit = 0
        self.specs = specs
        self.dense_bytes = sum(_nbytes(dt, shape) for dt, shape in specs.values())
        local = list({r.param.name: r.param for r in owned}.values())
        problem = None
        try:
            maps = converter.plan(local, layout, specs)
        except ConverterError as e:
            problem, maps = str(e), {}
        _raise_on_any_rank(problem)
        self._check_cover(maps, owned)
        self.coordinator = None
        if self.rank == 0:
            self.coordinator = Coordinator(transport.coordinator(), commit_log_for(transport, state_dir),
                                           timeout_s=timeout_s, key=key)
        version = bcast_json(self.coordinator.version if self.coordinator else None)
        rank_dir = None if baseline_dir is None else os.path.join(baseline_dir, f"rank{self.rank:05d}-of-{self.world}")
        self.baseline = Baseline(version=version, directory=rank_dir, fingerprint=fingerprint(
            asdict(layout), sorted(r.key for r in owned), sorted(specs.items()), type(converter).__name__))
        restored = gather_json(self.baseline.restored)
        problem = None
        if self.rank == 0 and version > 0 and not all(restored) and not assume_committed:
            missing = [r for r, ok in enumerate(restored) if not ok]
            problem = (f"the commit log is at version {version} but the committed baseline of rank(s) {missing[:8]} "
                       f"is not available ({self.baseline.restore_note or 'no baseline_dir'}): a refit against "
                       f"the current weights would leave receivers silently different. Keep baselines on disk "
                       f"(baseline_dir), start a new lineage (a fresh state_dir and version-0 receivers), or pass "
                       f"assume_committed=True if the model holds exactly version {version}'s weights")
        problem = bcast_json(problem)
        if problem:
            raise TransferFailed(problem)
        self.producer_ids = [f"p{r}" for r in range(self.world)]
        self.end = transport.producer(self.producer_ids[self.rank])
        problem = None
        try:  # computes the residual baselines: a residual that cannot run fails every rank, not one
            self.producer = Producer(self.producer_ids[self.rank], owned, maps, specs, self.baseline, self.end,
                                     op=op, key=key, max_payload_elements=max_payload_elements, params=params,
                                     encode_threads=encode_threads, wire_version=wire_version,
                                     state_digest=state_digest, conditioned=conditioned,
                                     device_payloads=device_payloads)
        except (ConverterError, ValueError, KeyError) as e:
            problem = f"rank {self.rank}: {type(e).__name__}: {e}"
        _raise_on_any_rank(problem)
        self.baseline.seal()
        # The model's whole-state digest, from the producers' disjoint shares (rank 0 keeps it).
        mine = self.producer.digest.hex() if self.producer.digest is not None else ""
        shares = gather_json([mine, self.producer.digest_load_s])
        self.state_digest = (add_hex(d for d, _ in shares) if state_digest else "") if self.rank == 0 else None
        self.digest_load_s = max(t for _, t in shares) if self.rank == 0 else 0.0  # the slowest rank's
        if self.history is not None:
            self.producer.keep_sent = True
            has_anchor = bool(self.history.versions(ANCHORS)) if self.rank == 0 else None
            if not bcast_json(has_anchor):  # catch-up needs an anchor to start from
                self._store_anchor(version)
        dist.barrier()

    def _check_cover(self, maps, owned) -> None:
        runs = coverage_runs(maps, owned, f"rank {self.rank}")
        compact = {n: [[s.tolist(), k.tolist(), who] for s, k, who in parts] for n, parts in runs.items()}
        gathered = gather_json(compact)
        problem = None
        if self.rank == 0:
            merged: dict[str, list] = {}
            for rank_runs in gathered:
                for name, parts in rank_runs.items():
                    merged.setdefault(name, []).extend(
                        (np.asarray(s, np.int64), np.asarray(n, np.int64), who) for s, n, who in parts)
            try:
                check_exact_cover(merged, {k: _numel(shape) for k, (_, shape) in self.specs.items()})
            except ConverterError as e:
                problem = str(e)
        problem = bcast_json(problem)
        if problem:
            raise ConverterError(problem)

    def refit(self) -> RefitResult:
        """Send the changes since the committed version; commit jointly or fail.

        A failed attempt (a payload lost, corrupted or rejected, an apply that failed, a
        receiver or producer that timed out) is retried in place up to `max_attempts` in
        all: receivers keep what they finished, and the retry re-sends the rest as
        overwrites. After the last attempt the transfer is aborted everywhere.

        Returns the result on every rank (producer reports are filled on rank 0).
        Raises TransferFailed (on every rank) when the transfer did not commit.
        """
        t0 = time.perf_counter()
        info = (self.coordinator.new_transfer(self.producer_ids, readback=self.readback, base_digest=self.state_digest)
                if self.rank == 0 else None)
        times: dict[str, float] = {}
        reports: list[dict] = []
        resynced: list[str] = []
        self._resync_s = 0.0
        for attempt in range(self.max_attempts):
            final = attempt == self.max_attempts - 1
            go = self._begin(info, resynced)
            info = self.transfer = TransferInfo.from_json(go["transfer"])
            if go["problems"]:
                decision = Decision(info.transfer_id, False, self.baseline.version, go["problems"])
                if self.rank == 0 and final:
                    self.coordinator.abort(info, "; ".join(go["problems"]))
            else:
                decision, reports = self._attempt(info, set(go["skip"]), final)
            times = {k: times.get(k, 0.0) + v for k, v in (self.coordinator.times if self.coordinator else {}).items()}
            if decision.committed or final:
                break
            self.log(f"refit: attempt {attempt + 1} of transfer {info.lineage_id} failed, retrying with overwrites: "
                     + "; ".join(decision.reasons)[:500])
            if self.rank == 0:
                info = info.retry()
        decision = self._decide(info, decision, reports)
        if self.history is not None:
            t = time.perf_counter()
            self._store_delta(decision.version)
            if self.anchor_due or (self.anchor_every and decision.version % self.anchor_every == 0):
                self._store_anchor(decision.version)
            times["history"] = time.perf_counter() - t
        failed, self.failed_since_commit = self.failed_since_commit, 0
        return RefitResult(decision, info, reports or [], time.perf_counter() - t0, self.dense_bytes, times, failed,
                           attempts=info.attempt + 1, base_digest=info.base_digest, resynced=resynced,
                           resync_s=self._resync_s)

    def _begin(self, info: TransferInfo | None, resynced: list[str]) -> dict:
        """Announce an attempt on every rank; when the only problems are receivers that do
        not hold its base (by state digest, version or uncertain bits), resync them densely
        first (once a refit) and announce it again. Returns rank 0's word: the transfer,
        the problems, the payloads finished everywhere."""
        while True:
            problems, skip, resync = [], [], []
            if self.rank == 0:
                problems = self.coordinator.begin(info)
                skip = self.coordinator.finished_everywhere
                need = self.coordinator.resync_needed
                if need and len(need) == len(problems) and not resynced:
                    resync = sorted(need)
            go = bcast_json({"transfer": info.to_json() if info else None, "problems": problems, "skip": skip,
                             "resync": resync})
            if not go["resync"]:
                return go
            resynced.extend(go["resync"])
            self._resync(go["resync"])

    def _resync(self, receivers: list[str]) -> None:
        """Collective: every producer sends its share of the committed version as overwrites
        to the receivers that do not hold it (`Producer.resync`); rank 0 first logs which
        tensors differ, where a receiver said what it holds."""
        t = time.perf_counter()
        shares = gather_json((self.producer.digest or StateDigest()).to_json())
        if self.rank == 0:
            ours = StateDigest()
            for share in shares:
                ours.merge(StateDigest.from_json(share))
            for rx in receivers:
                theirs = self.coordinator.resync_needed.get(rx)
                where = (f"; tensors that differ: {StateDigest.from_json(theirs).differing(ours)}"
                         if isinstance(theirs, dict) else "")
                self.log(f"refit: receiver {rx} does not hold version {self.baseline.version} "
                         f"(state digest {self.state_digest}){where}: resyncing it from the producers' shares")
        rinfo = self.coordinator.new_resync(self.producer_ids, self.state_digest) if self.rank == 0 else None
        go = bcast_json({"transfer": rinfo.to_json() if rinfo else None,
                         "problems": self.coordinator.begin(rinfo) if self.rank == 0 else []})
        rinfo = TransferInfo.from_json(go["transfer"])
        if go["problems"]:
            if self.rank == 0:
                self.coordinator.abort(rinfo, "; ".join(go["problems"]))
                self.log(f"refit: resync {rinfo.transfer_id} could not start: " + "; ".join(go["problems"])[:500])
            return
        try:
            report = self.producer.resync(rinfo)
        except Exception as e:  # noqa: BLE001 - any producer failure fails the resync
            report = ProducerReport(self.producer.id, error=f"{type(e).__name__}: {e}")
        reports = gather_json(report.to_json())
        if self.rank == 0:
            bad = [f"producer {r['producer_id']}: {r['error']}" for r in reports if r["error"]]
            bad += [f"{rx} rejected {pid}: {why}" for r in reports for rx, d in r["rejected"].items()
                    for pid, why in d.items()]
            decision = self.coordinator.finish(rinfo, bad, payload_ids=[p for r in reports for p in r["payload_ids"]],
                                               target_digest=self.state_digest)
            self.log(f"refit: resync {rinfo.transfer_id} " + ("done" if decision.committed else
                     "failed: " + "; ".join(decision.reasons)[:500]))
        dist.barrier()
        self._resync_s += time.perf_counter() - t

    # --- history (catch-up for receivers), after the commit -----------------------------

    def _store(self, kind: str, version: int, produce) -> bool:
        """Every rank stores its payloads; rank 0 then writes the manifest (last, so an
        entry is complete or absent). False (on every rank) when any rank failed."""
        try:
            ids, error = produce(lambda pid, data: self.history.put_payload(kind, version, pid, data)), None
        except Exception as e:  # noqa: BLE001 - a history failure must not fail the committed refit
            ids, error = {}, f"rank {self.rank}: {type(e).__name__}: {e}"
        gathered = gather_json({"ids": ids, "error": error})
        problem = None
        if self.rank == 0:
            problem = next((g["error"] for g in gathered if g["error"]), None)
            if problem is None:
                try:
                    self.history.put_manifest(kind, version, {p: t for g in gathered for p, t in g["ids"].items()},
                                              self.key)
                    if kind == ANCHORS:
                        self.history.prune(self.keep_anchors, self.key)
                except Exception as e:  # noqa: BLE001
                    problem = f"rank 0: {type(e).__name__}: {e}"
        problem = bcast_json(problem)
        if problem:
            self.log(f"refit: storing the {kind} of version {version} failed ({problem}); "
                     "receivers cannot catch up past it until the next anchor")
        return problem is None

    def _store_delta(self, version: int) -> None:
        def produce(put):
            sent = self.producer.sent
            for pid, (_, data) in sent.items():
                put(pid, data.cpu().numpy() if isinstance(data, torch.Tensor) else data)  # device payloads
            return {pid: tid for pid, (tid, _) in sent.items()}
        if not self._store(DELTAS, version, produce):
            self.anchor_due = True
        self.producer.sent = {}

    def _store_anchor(self, version: int) -> None:
        self.anchor_due = not self._store(ANCHORS, version, lambda put: self.producer.anchor(version, put))

    def _attempt(self, info: TransferInfo, skip: set[str], final: bool) -> tuple[Decision, list[dict]]:
        """One attempt: every rank produces; rank 0 decides (commit, or fail)."""
        try:
            report = self.producer.refit(info, skip=skip)
            self.baseline.persist_pending()  # durable before rank 0 can write the commit record
        except Exception as e:  # noqa: BLE001 - any producer failure fails the whole attempt
            report = ProducerReport(self.producer.id, error=f"{type(e).__name__}: {e}")
        reports = gather_json(report.to_json())
        decision = None
        if self.rank == 0:
            bad = [f"producer {r['producer_id']}: {r['error']}" for r in reports if r["error"]]
            bad += [f"{rx} rejected {pid}: {why}" for r in reports for rx, d in r["rejected"].items()
                    for pid, why in d.items()]
            every = [pid for r in reports for pid in r.get("all_payload_ids", [])]
            readback = {pid: d for r in reports for pid, d in r.get("readback", {}).items()}
            decision = self.coordinator.finish(
                info, bad, payload_ids=every, final=final, readback=readback if info.readback else None,
                target_digest=None if bad or not info.base_digest else add_hex(r["state_digest"] for r in reports),
                payload_digests={pid: d for r in reports for pid, d in r["payload_digests"].items()})
        return Decision(**bcast_json(decision.to_json() if decision else None)), reports or []

    def _decide(self, info: TransferInfo, decision: Decision, reports: list[dict]) -> Decision:
        self.producer.settle(decision.committed)
        if decision.committed:
            self.baseline.commit()
            if self.rank == 0 and self.state_digest:
                self.state_digest = add_hex(r["state_digest"] for r in reports)
        else:
            self.baseline.abort()
            self.failed_since_commit += 1
            raise TransferFailed(f"transfer {info.lineage_id} did not commit after {info.attempt + 1} attempt(s): "
                                 + "; ".join(decision.reasons))
        return decision

    def verify(self, expected_digests: dict[str, str] | None = None) -> dict[str, list[str]]:
        """Rank 0 (other ranks get {}): check every receiver bit for bit. Returns each
        receiver's problems; all lists empty when every receiver holds exactly the
        committed version.

        Without `expected_digests`, from the producers' whole-state digest of the committed
        version, which needs no gather: each receiver reads its whole state again, and
        must serve the committed version and hold that digest. A receiver that keeps no
        whole-state digest (one holding parts of tensors) is reported as unproven. With
        `expected_digests` (name -> `verify.state_digests` of a dense export), tensor by
        tensor."""
        from nemo_dcr.verify import compare_digests

        if self.rank != 0:
            return {}
        out = {}
        for rx, r in sorted(self.coordinator.verify().items()):
            if r.get("error"):
                out[rx] = [r["error"]]
            elif expected_digests is not None:
                out[rx] = compare_digests(expected_digests, r["digests"])
            else:
                out[rx] = self._state_problems(r)
        return out

    def _state_problems(self, reply: dict) -> list[str]:
        problems = []
        if reply.get("version") != self.baseline.version:
            problems.append(f"serves version {reply.get('version')}, the committed one is {self.baseline.version}")
        if not self.state_digest:
            problems.append("unproven: the producers keep no state digest (state_digest=False); "
                            "pass expected_digests")
        elif not reply.get("state_digest"):
            problems.append("unproven: the receiver keeps no whole-state digest (it holds parts of tensors, "
                            "or state_digest=False); pass expected_digests")
        elif reply["state_digest"] != self.state_digest:
            problems.append(f"state digest {reply['state_digest']}, the producers' is {self.state_digest}")
        return problems

    def close(self, shutdown_receivers: bool = False) -> None:
        self.baseline.wait_committed()
        self.end.close()
        if self.coordinator is not None:
            if shutdown_receivers:
                self.coordinator.shutdown()
            self.coordinator.end.close()


def ensure_process_group() -> None:
    """The process group the refit's metadata collectives run on: the default one. A
    single process without one (a plain PyTorch trainer) gets a local one-rank group;
    ranks started by a launcher (WORLD_SIZE > 1) must create theirs first."""
    if dist.is_initialized():
        return
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world != 1:
        raise RuntimeError(f"TrainerRefit: torch.distributed is not initialized in this rank, and WORLD_SIZE={world}: "
                           "call torch.distributed.init_process_group(...) on every rank before building it")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _raise_on_any_rank(problem: str | None) -> None:
    """Collective: raise ConverterError on every rank if any rank has a problem."""
    problems = gather_json(problem)
    first = next((p for p in problems if p), None) if dist.get_rank() == 0 else None
    first = bcast_json(first)
    if first:
        raise ConverterError(first)


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) if len(shape) else 1


def _nbytes(dtype_name: str, shape) -> int:
    from nemo_dcr.dtypes import from_name

    return _numel(shape) * from_name(dtype_name).itemsize


# --- small JSON collectives (metadata only; parameters never travel this way) ----------

def _to_tensor(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def bcast_json(obj, src: int = 0):
    size = torch.tensor([len(json.dumps(obj).encode()) if dist.get_rank() == src else 0], dtype=torch.int64)
    dist.broadcast(size, src)
    buf = _to_tensor(obj) if dist.get_rank() == src else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src)
    return json.loads(bytes(buf.numpy()))


def gather_json(obj, dst: int = 0):
    """List of every rank's object on `dst` (None elsewhere)."""
    mine = _to_tensor(obj)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64))
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: mine.numel()] = mine
    out = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(out, padded)
    if dist.get_rank() != dst:
        return None
    return [json.loads(bytes(o[: int(s.item())].numpy())) for o, s in zip(out, sizes)]
