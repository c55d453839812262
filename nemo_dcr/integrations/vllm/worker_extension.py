"""vLLM worker extension: a NeMo-DCR receiver inside each vLLM worker, driven through
`collective_rpc` (`worker_extension_cls="nemo_dcr.integrations.vllm.worker_extension.
DCRWorkerExtension"`). Each worker applies its own share through `runtimes.vllm.VLLMRuntime`.
The `backend: "dcr"` weight-transfer engine (`engine.py`) reuses its receiver machinery.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from contextlib import contextmanager

import torch

from nemo_dcr.errors import ApplyError
from nemo_dcr.runtimes.vllm import VLLMRuntime
from nemo_dcr.verify import state_digests

_log = logging.getLogger("nemo_dcr.vllm")


class DCRWorkerExtension:
    """vLLM worker extension: a NeMo-DCR receiver inside each vLLM worker.

    Pass `worker_extension_cls="nemo_dcr.integrations.vllm.worker_extension.DCRWorkerExtension"` to `LLM` /
    `--worker-extension-cls`, then call the methods through `llm.collective_rpc(name,
    args=...)`. The receiver is driven on the worker's own thread (`dcr_serve`), between
    engine steps, so an apply never races a forward pass. Method names start with
    `dcr_` so they cannot clash with the worker's own.

    With `dcr_background_start()`, a thread stages payloads (decode, validate,
    acknowledge) while the engine keeps generating, and `dcr_update(version)` does the
    rest (apply, commit or abort) on the worker's thread: generation pauses only for the
    apply.
    """

    def _dcr_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def dcr_start(self, checkpoint_dir: str, transport: str, transport_config: dict, receiver_id: str,
                  key_env: str | None = None, version: int = 0, history: str | None = None,
                  holds_checkpoint: bool | None = None, conditioned: bool = False) -> dict:
        """Build the adapter on this worker's model and open a receiver end (`history`: a
        directory or "s3" to catch up from when behind or uncertain). `holds_checkpoint`:
        whether the engine loaded `checkpoint_dir` (default: unless its load format is
        "dummy"); one that did not is resynced densely by its first refit.

        `checkpoint_dir`: a folder, or a Hugging Face hub id the engine loaded (resolved
        in the local cache, vLLM's `download_dir` if set). `conditioned`: the trainer codes
        records against the committed bits (`TrainerRefit(conditioned=True)`); vLLM's
        weights are fused, repacked and sharded, so the receiver keeps a canonical host
        mirror (`nemo_dcr.mirror.CanonicalMirror`) of every canonical tensor this worker
        serves, read from `checkpoint_dir`: one whole copy of each, also under TP (2 bytes
        a BF16 parameter), decoded against when a payload is staged."""
        from nemo_dcr import registry
        from nemo_dcr.history import open_history
        from nemo_dcr.receiver import Receiver
        from nemo_dcr.runtimes.scatter import default_threads

        t = time.perf_counter()
        if getattr(self, "_dcr_thread", None) is not None:
            self.dcr_background_stop()  # a new receiver: the old one's staging thread goes first
        if hasattr(self, "_dcr_lock"):
            self._dcr_deferred.clear()
            self._dcr_begun.clear()
            self._dcr_done.clear()
        tp = int(getattr(self.parallel_config, "tensor_parallel_size", 1) or 1) if hasattr(
            self, "parallel_config") else 1
        rank = int(getattr(self, "rank", 0) or 0)
        if holds_checkpoint is None:  # an engine started on dummy weights holds no version
            load_format = getattr(getattr(getattr(self, "vllm_config", None), "load_config", None), "load_format", None)
            holds_checkpoint = str(getattr(load_format, "value", load_format)) != "dummy"
        checkpoint_dir = self._dcr_checkpoint(checkpoint_dir)
        runtime = VLLMRuntime(self._dcr_model(), checkpoint_dir, full_coverage=tp == 1,
                              holds_checkpoint=holds_checkpoint)
        mirror = None
        if conditioned and not getattr(runtime, "canonical_layout", False):
            mirror = self._dcr_mirror(checkpoint_dir, runtime)
        rid = receiver_id if tp == 1 else f"{receiver_id}-tp{rank}"
        key = None
        if key_env:
            value = os.environ.get(key_env)
            if not value:
                raise ApplyError(f"HMAC key variable {key_env} is not set in the worker")
            key = value.encode()
        wiring = registry.transport(transport, dict(transport_config))
        self._dcr_receiver = Receiver(rid, runtime, wiring.receiver(rid), version=version, key=key,
                                      history=open_history(history, wiring), mirror=mirror,
                                      decode_threads=default_threads(tp, cap=None))  # the TP workers share the cores
        if mirror is not None:
            _log.info("nemo-dcr: receiver %s keeps a canonical mirror of %d tensors from %s for conditioned "
                      "coding: %.1f MiB of host memory", rid, len(mirror), checkpoint_dir,
                      mirror.nbytes / 2**20)
        return {"receiver_id": rid, "catalog": len(runtime.catalog()), "ignored": dict(runtime.ignored),
                "mirror_bytes": 0 if mirror is None else mirror.nbytes,
                "kept_loader_format": sorted(f"{type(m).__name__}.{n}" for m, ps in runtime._kept.items()
                                             for n in ps),
                "holds_checkpoint": holds_checkpoint, "state_digest": self._dcr_receiver.state_digest,
                "setup_s": time.perf_counter() - t}

    def _dcr_checkpoint(self, checkpoint_dir: str) -> str:
        """`checkpoint_dir` as a folder: a hub id is looked up in the local cache."""
        if os.path.isdir(checkpoint_dir):
            return checkpoint_dir
        from nemo_dcr.checkpoint import local_checkpoint

        config = getattr(self, "vllm_config", None)
        revision = getattr(getattr(config, "model_config", None), "revision", None)
        cache_dir = getattr(getattr(config, "load_config", None), "download_dir", None)
        try:
            return str(local_checkpoint(checkpoint_dir, revision=revision, cache_dir=cache_dir))
        except FileNotFoundError as e:
            raise ApplyError(f"cannot read the catalog of {checkpoint_dir}: {e}") from None

    @staticmethod
    def _dcr_mirror(checkpoint_dir: str, runtime: VLLMRuntime):
        """The canonical host mirror of every tensor `runtime` serves, from the checkpoint
        the engine loaded (one started on dummy weights is resynced densely by its first
        refit, which moves the mirror too)."""
        from nemo_dcr.mirror import CanonicalMirror

        return CanonicalMirror.from_checkpoint(checkpoint_dir, names=runtime.catalog())

    def dcr_serve(self, until_version: int | None = None, timeout_s: float = 60.0, poll_s: float = 0.02) -> dict:
        """Handle transport events until serving `until_version` (or shutdown / timeout)."""
        rx = self._dcr_receiver
        deadline = time.monotonic() + timeout_s
        events = 0
        with self._dcr_foreground():
            while until_version is None or rx.serving_version < until_version:
                if time.monotonic() > deadline:
                    break
                event = self._dcr_next_event(poll_s)
                if event is None:
                    continue
                events += 1
                if not rx.handle(event):
                    break
        return {"version": rx.serving_version, "events": events,
                "reprocess_s": rx.runtime.reprocess_s}

    # -- staging in the background, applying only inside `dcr_update` -------------------
    #
    # A background thread on the worker handles only what never touches the model:
    # `begin` (when nothing applied is pending revert) and the payloads of the open
    # transfer (decode, validate, stage, acknowledge), so the producers' streams and
    # flushes complete while the engine keeps generating. Everything else (manifests,
    # which trigger the apply; commit, abort, verify, shutdown) is queued, in order, for
    # the next foreground call (`dcr_update`, `dcr_serve`), which the engine runs between
    # steps: the apply, and so the generation pause, happens only there.

    def _dcr_state(self):
        if not hasattr(self, "_dcr_lock"):
            self._dcr_lock = threading.RLock()
            self._dcr_pause = threading.Event()
            self._dcr_stop = threading.Event()
            self._dcr_deferred: deque = deque()
            self._dcr_thread = None
            self._dcr_bg_payloads = 0
            self._dcr_begun: dict[str, float] = {}  # transfer id -> when its begin was handled
            self._dcr_done: set[str] = set()  # transfers already reported by dcr_update
        return self._dcr_lock

    @contextmanager
    def _dcr_foreground(self):
        """Hold the receiver: the background thread stays out until the block ends."""
        lock = self._dcr_state()
        self._dcr_pause.set()
        try:
            with lock:
                yield
        finally:
            self._dcr_pause.clear()

    def _dcr_next_event(self, poll_s: float):
        """The oldest deferred event, else the next one from the transport (lock held)."""
        if self._dcr_deferred:
            return self._dcr_deferred.popleft()
        return self._dcr_receiver.end.poll(poll_s)

    def _dcr_stageable(self, event) -> bool:
        """May the background thread handle `event` without touching the model?"""
        rx = self._dcr_receiver
        cur = rx.current
        if event.kind == "begin":
            return not self._dcr_deferred and (cur is None or not cur.applied)
        if event.kind == "payload":
            # staging only: with no manifest handled yet, the receiver cannot start its apply
            return (cur is not None and not cur.applied and not cur.replied and not cur.manifests
                    and event.meta.get("transfer_id") == cur.info.transfer_id)
        if event.kind == "abort":  # a repeated abort of a transfer already over here changes nothing
            tid = event.meta.get("transfer_id")
            return (tid in self._dcr_done or tid not in self._dcr_begun) and (
                cur is None or cur.info.transfer_id != tid)
        return False

    def _dcr_background(self, poll_s: float) -> None:
        rx = self._dcr_receiver
        while not self._dcr_stop.is_set():
            if self._dcr_pause.is_set():
                time.sleep(poll_s)
                continue
            with self._dcr_lock:
                if self._dcr_stop.is_set() or rx is not self._dcr_receiver:
                    return
                event = rx.end.poll(poll_s)
                if event is None:
                    continue
                if not self._dcr_stageable(event):
                    self._dcr_deferred.append(event)
                    continue
                if event.kind == "payload":
                    self._dcr_bg_payloads += 1
                kind, tid = event.kind, (event.meta.get("transfer") or {}).get("transfer_id")
                try:
                    rx.handle(event)
                except Exception as exc:  # noqa: BLE001 - keep staging; the transfer fails on its own
                    _log.warning("nemo-dcr staging thread: %s event failed: %s: %s", event.kind,
                                 type(exc).__name__, exc)
                if kind == "begin" and rx.refused is None:  # a refused begin (replayed, forged) began nothing
                    self._dcr_begun[tid] = time.time()

    def dcr_background_start(self, poll_s: float = 0.02) -> dict:
        """Stage payloads on a background thread from now on (see `dcr_update`)."""
        self._dcr_state()
        if self._dcr_thread is None or not self._dcr_thread.is_alive():
            self._dcr_stop.clear()
            self._dcr_thread = threading.Thread(target=self._dcr_background, args=(poll_s,),
                                                name="nemo-dcr-stage", daemon=True)
            self._dcr_thread.start()
        return {"background": True}

    def dcr_background_stop(self) -> None:
        self._dcr_state()
        self._dcr_stop.set()
        if self._dcr_thread is not None:
            self._dcr_thread.join(timeout=10)
            self._dcr_thread = None

    def dcr_stage_status(self) -> dict:
        """What the receiver holds now: serving version, the open transfer's staged
        payloads, and the events queued for the next foreground call."""
        with self._dcr_foreground():
            rx = self._dcr_receiver
            cur = rx.current
            return {"version": rx.serving_version,
                    "transfer_id": None if cur is None else cur.info.transfer_id,
                    "staged": 0 if cur is None else len(cur.staged),
                    "applied": bool(cur is not None and cur.applied),
                    "deferred": [e.kind for e in self._dcr_deferred],
                    "background_payloads": self._dcr_bg_payloads,
                    "background_alive": bool(self._dcr_thread is not None and self._dcr_thread.is_alive())}

    def dcr_update(self, expected_version: int | None = None, timeout_s: float = 300.0,
                   await_verify: bool = False, poll_s: float = 0.01) -> dict:
        """Finish the transfer to `expected_version` (default: serving + 1) in place.

        Handles the queued events, then the transport's, on this thread: the apply (once
        every manifest is in and every payload staged), then the coordinator's decision.
        Returns {"ok": True, ...} once the worker serves `expected_version` (and, with
        `await_verify`, has answered the coordinator's verify request that follows the
        commit); {"ok": False, "reason": ...} when that transfer is aborted, on shutdown
        or after `timeout_s`, with the previous version still serving (an applied
        transfer is reverted by the abort)."""
        t0 = time.perf_counter()
        with self._dcr_foreground():
            rx = self._dcr_receiver
            expected = rx.serving_version + 1 if expected_version is None else int(expected_version)
            cur = rx.current
            out = {"ok": False, "reason": None, "version": rx.serving_version, "expected_version": expected,
                   "staged_before_call": 0 if cur is None else len(cur.staged),
                   "background_payloads": self._dcr_bg_payloads, "events": 0, "apply_s": 0.0, "stage_s": 0.0,
                   "transfer_id": None if cur is None else cur.info.transfer_id}
            self._dcr_bg_payloads = 0
            if rx.serving_version >= expected and not await_verify:
                out.update(ok=True, version=rx.serving_version)
                return out
            verified = False
            deadline = time.monotonic() + timeout_s
            while True:
                if rx.serving_version >= expected and (verified or not await_verify):
                    out["ok"] = True
                    break
                if time.monotonic() > deadline:
                    out["reason"] = (f"receiver {rx.id}: no commit of version {expected} within {timeout_s:.0f} s "
                                     f"(serving {rx.serving_version})")
                    # Reported as failed: a later abort of these transfers is not the next update's.
                    self._dcr_done.update(self._dcr_begun)
                    break
                event = self._dcr_next_event(poll_s)
                if event is None:
                    continue
                out["events"] += 1
                kind, meta = event.kind, dict(event.meta)
                tid = meta.get("transfer_id")
                cur = rx.current
                if kind == "begin":
                    tid = meta["transfer"]["transfer_id"]
                aborts_ours = kind == "abort" and tid not in self._dcr_done and (
                    tid in self._dcr_begun or (cur is not None and cur.info.transfer_id == tid))
                alive = rx.handle(event)
                if rx.refused is not None:
                    continue  # forged, replayed or from an older trainer: it decides nothing here either
                if kind == "begin":
                    self._dcr_begun[tid] = time.time()
                if cur is not None and kind in ("commit", "abort") and cur.info.transfer_id == tid:
                    out.update(transfer_id=tid, apply_s=cur.apply_s, stage_s=cur.stage_s)
                if kind == "verify":
                    verified = rx.serving_version >= expected
                if kind == "commit" and rx.serving_version >= expected:
                    self._dcr_done.add(tid)
                if aborts_ours:
                    self._dcr_done.add(tid)
                    out["reason"] = f"transfer {tid} aborted: {meta.get('reason')}"
                    break
                if not alive:
                    out["reason"] = "the coordinator shut the receiver down"
                    break
            out["version"] = rx.serving_version
            out["background_alive"] = bool(self._dcr_thread is not None and self._dcr_thread.is_alive())
            out["update_s"] = time.perf_counter() - t0
            out["reprocess_s"] = rx.runtime.reprocess_s
            return out

    def dcr_version(self) -> int:
        return self._dcr_receiver.serving_version

    def dcr_digests(self) -> dict[str, str]:
        """BLAKE2b of every canonical tensor this worker holds (see `Receiver.digests`)."""
        with self._dcr_foreground():
            return self._dcr_receiver.digests()

    def dcr_loader_digests(self, checkpoint_dir: str | None = None) -> dict[str, str]:
        """BLAKE2b of every vLLM parameter and buffer in loader format.

        The receiver's own view where this worker has one (this extension's, or that of
        a `backend: "dcr"` weight-transfer engine): kept loader-format parameters are
        not recoverable from a kernel format. On a model with no receiver (a fresh load
        to compare with), `checkpoint_dir` names the checkpoint it was loaded from, to
        build the adapter."""
        engine_host = getattr(getattr(self, "weight_transfer_engine", None), "host", None)
        rx = getattr(self, "_dcr_receiver", None) or getattr(engine_host, "_dcr_receiver", None)
        runtime = rx.runtime if rx is not None else VLLMRuntime(self._dcr_model(), checkpoint_dir)
        return state_digests(runtime.loader_state())

    def dcr_close(self) -> None:
        rx = getattr(self, "_dcr_receiver", None)
        if rx is not None:
            self.dcr_background_stop()
            with self._dcr_foreground():
                for event in self._dcr_deferred:
                    event.release()
                self._dcr_deferred.clear()
                rx.end.close()
                self._dcr_receiver = None
