"""vLLM receiver: records applied in place through the model's own `load_weights`.

`VLLMRuntime` is the vLLM half of the receiver. The native loader is the loaded
model's `load_weights(iterable of (name, tensor))`: vLLM's per-parameter weight
loaders pack q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, narrow for tensor
parallelism, skip tied aliases, and so on. The interception engine
(`nemo_dcr.runtimes.intercept`) runs that loader on scratch tensors and records the
geometry of every `copy_` into model storage; nothing here knows a model family.

*Loader format and kernel format.* vLLM records, for every layer, the parameters as
the loaders write them (`record_metadata_for_reloading`, the metadata its own
in-place `reload_weights` restores), and after loading runs each layer's
`quant_method.process_weights_after_loading`, which may turn them into a kernel
format: on CPUs the unquantized linear layers are prepacked for oneDNN / AMX and
their `weight` replaced by an empty tensor, and the (tied) LM head gets a packed copy
of the embedding. Writing the loader-format bits in place would then change nothing
that serves. So, for every layer whose live parameters differ from vLLM's recorded
loader format, the adapter keeps loader-format parameters of its own (materialised
from vLLM's metadata, filled once from the version-0 checkpoint through
`load_weights`), swaps them into the layer while the loader runs, and after every
apply or revert re-runs vLLM's own `process_weights_after_loading` for each layer a
record wrote. Processing is checked to leave the loader-format bits untouched. On a
GPU with unquantized weights nothing is kept and processing is a no-op: records land
directly in the serving tensors. Quantized models are refused (their processing is
not a pure function of the loaded bits that can be re-run).

`DCRWorkerExtension` is a vLLM worker extension (`worker_extension_cls=
"nemo_dcr.runtimes.vllm.DCRWorkerExtension"`): its methods run in every worker
through `LLM.collective_rpc`, so each worker applies its own share.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager

import torch

from nemo_dcr import dtypes
from nemo_dcr.checkpoint import CheckpointReader, read_specs
from nemo_dcr.errors import ApplyError
from nemo_dcr.records import Record
from nemo_dcr.runtimes.base import Catalog, UndoLog
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_dcr.runtimes.intercept import (NativeLoaderAdapter, _Restore, _View, _written, module_fingerprint,
                                         module_storages, storage_key)
from nemo_dcr.verify import state_digests

_log = logging.getLogger("nemo_dcr.vllm")


def _layerwise_metadata(layer: torch.nn.Module):
    """vLLM's recorded loader-format (params, buffers) of `layer`, or None."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # older vLLM: no recorded loader format
        return None
    info = LAYERWISE_INFO.get(layer)
    return None if info is None else info


def _same_format(live: torch.Tensor | None, meta: torch.Tensor) -> bool:
    return (live is not None and tuple(live.shape) == tuple(meta.shape) and live.dtype == meta.dtype
            and tuple(live.stride()) == tuple(meta.stride()))


class VLLMRuntime(NativeLoaderAdapter):
    """A loaded vLLM model (`nn.Module`) written through its own `load_weights`.

    checkpoint_dir: the version-0 canonical checkpoint the model was loaded from; its
    safetensors headers are the catalog, less the tensors vLLM's loader skips (tied
    aliases: see `ignored`). full_coverage: the loader must consume every element of a
    tensor it loads; False for tensor parallelism, where each worker loads its own slice.
    holds_checkpoint: the model was loaded from `checkpoint_dir` (True), or holds other
    bits (False: an engine started with `load_format="dummy"`, as NeMo RL starts its
    rollout engines). Layers whose serving format differs from the loader's keep a
    loader-format copy the adapter writes into; with the checkpoint it is filled from
    there, else with zeros, so that it never claims bits the engine does not serve: the
    whole-state digest then differs from any version's, and the receiver's first begin
    asks for a dense resync, which overwrites every element and re-processes every layer.
    """

    def __init__(self, model: torch.nn.Module, checkpoint_dir: str | os.PathLike, *,
                 full_coverage: bool = True, scratch_device: str | torch.device | None = None,
                 holds_checkpoint: bool = True):
        self.model = model
        self.full_coverage = full_coverage
        first = next(model.parameters(), None)
        self.scratch_device = scratch_device or (first.device if first is not None else "cpu")
        self._refuse_quantized()
        try:
            specs = read_specs(checkpoint_dir)
        except (FileNotFoundError, ValueError) as exc:
            raise ApplyError(f"cannot read the catalog of {checkpoint_dir}: {exc}") from exc
        self._catalog: Catalog = dict(specs)
        self.ignored: dict[str, str] = {}
        self._readback: dict[str, object] | None = None
        self.reprocess_s = 0.0
        # loader-format parameters kept for layers whose serving format differs
        self._kept: dict[torch.nn.Module, dict[str, torch.nn.Parameter]] = {}
        self._owner: dict[int, torch.nn.Module] = {}  # storage -> layer that processes it
        self._build_kept()
        if self._kept and holds_checkpoint:
            self._fill_kept(checkpoint_dir)
        else:
            with torch.no_grad():
                for params in self._kept.values():
                    for p in params.values():
                        p.zero_()
        self._probe_catalog()

    # -- set-up -------------------------------------------------------------------
    def _refuse_quantized(self) -> None:
        for name, module in self.model.named_modules():
            qm = getattr(module, "quant_method", None)
            if qm is not None and not type(qm).__name__.startswith("Unquantized"):
                raise ApplyError(f"{name}: quantization method {type(qm).__name__} is not supported; "
                                 "its post-load processing cannot be re-run on applied bits")

    def _build_kept(self) -> None:
        try:
            from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
            from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
        except ImportError:
            return
        for layer in self.model.modules():
            info = _layerwise_metadata(layer)
            if info is None:
                continue
            params, _ = info.restore_metadata
            for name, meta in params.items():
                live = layer._parameters.get(name)
                if _same_format(live, meta):
                    continue
                with info.restore_device:
                    p = materialize_meta_tensor(restore_layer_refs(meta, layer))
                self._kept.setdefault(layer, {})[name] = p
        for layer in self._layers_with_processing():
            for t in list(layer._parameters.values()) + list(layer._buffers.values()):
                if t is not None:
                    self._owner[storage_key(t)] = layer
            for p in self._kept.get(layer, {}).values():
                self._owner[storage_key(p)] = layer

    def _layers_with_processing(self) -> list[torch.nn.Module]:
        return [m for m in self.model.modules() if getattr(m, "quant_method", None) is not None]

    def _fill_kept(self, checkpoint_dir) -> None:
        """Version-0 values of the kept loader-format parameters, through `load_weights`.

        Only the kept parameters are written: every other write of this load is
        intercepted and dropped (the model already holds version 0 there).
        """
        reader = CheckpointReader(checkpoint_dir)
        kept = {storage_key(p) for ps in self._kept.values() for p in ps.values()}
        destinations = self._destinations()

        class _OnlyKept(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                written = [storage_key(t) for t in _written(func, args, kwargs) if t.numel()]
                if any(k in destinations and k not in kept for k in written):
                    return args[0]  # version 0 is already there: leave the serving tensors alone
                return func(*args, **kwargs)

        with torch.no_grad(), _OnlyKept():
            self._load({n: reader.get(n) for n in reader.names()})

    def _probe_catalog(self) -> None:
        """Drop checkpoint tensors the loader skips (tied aliases): one scratch load."""
        names = sorted(self._catalog)
        tensors = {n: self._scratch(n) for n in names}
        by_key = {storage_key(t): n for n, t in tensors.items()}
        mode = self._intercepted_load(tensors)
        loaded = {by_key[k] for k in (storage_key(src) for _, src in mode.copies) if k in by_key}
        for name in names:
            if name not in loaded:
                self.ignored[name] = "vLLM's loader skips it (tied or unused)"
                del self._catalog[name]

    # -- engine hooks ---------------------------------------------------------------
    def catalog(self) -> Catalog:
        return dict(self._catalog)

    def _destinations(self) -> dict[int, str]:
        out = module_storages(self.model)
        prefix = {m: n for n, m in self.model.named_modules()}
        for layer, params in self._kept.items():
            for pname, p in params.items():
                out.setdefault(storage_key(p), f"{prefix.get(layer, '?')}.{pname} (loader format)")
        return out

    def _layout(self) -> tuple:
        # storage and vLLM's extension point, each parameter's `weight_loader` (it may be
        # replaced at run time), for the model and the kept loader-format parameters
        kept = tuple((storage_key(p), getattr(p, "weight_loader", None))
                     for ps in self._kept.values() for p in ps.values())
        return module_fingerprint(self.model), kept

    def _swap_in(self) -> list[tuple[torch.nn.Module, str, object]]:
        saved = []
        for layer, params in self._kept.items():
            for name, p in params.items():
                saved.append((layer, name, layer._parameters.get(name)))
                layer._parameters[name] = p
        return saved

    @staticmethod
    def _swap_out(saved) -> None:
        for layer, name, live in reversed(saved):
            if live is None:
                layer._parameters.pop(name, None)
            else:
                layer._parameters[name] = live

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        saved = self._swap_in()
        try:
            self.model.load_weights(iter(list(tensors.items())))
        finally:
            self._swap_out(saved)

    def _refresh(self) -> None:
        self._readback = None

    def canonical_state(self) -> dict[str, torch.Tensor]:
        """Canonical tensors read back through the loader's own copy geometry.

        A tensor the loader copies whole into one contiguous parameter is returned as
        that (live) tensor; any other is assembled from its destinations. Under tensor
        parallelism the elements this worker does not hold are zero.
        """
        return {name: self._assembled(plan) for name, plan in self._readback_plans().items()}

    def _readback_plans(self) -> dict:
        if self._readback is None:  # geometry only: try scratch on the meta device first
            device, self.scratch_device = self.scratch_device, "meta"
            try:
                plans = self._plan(set(self._catalog))
            except ApplyError:
                plans = None
            finally:
                self.scratch_device = device
            self._readback = plans if plans is not None else self._plan(set(self._catalog))
        return self._readback

    @staticmethod
    def _assembled(plan) -> torch.Tensor:
        if plan.identity:
            return plan.copies[0].dst
        t = torch.zeros(plan.shape, dtype=plan.dtype.torch_dtype, device=plan.copies[0].dst.device)
        flat = t.view(-1)
        for c in plan.copies:
            if c.src == _View((), (), 0):
                raise ApplyError(f"{plan.name}: the loader transforms it; it cannot be read back")
            flat.as_strided(c.src.size, c.src.stride, c.src.offset).copy_(c.dst.detach())
        return t

    def _canonical_tensor(self, name: str) -> torch.Tensor:
        return self._assembled(self._readback_plans()[name])  # this tensor alone, not the whole state

    # -- apply / revert, then vLLM's own post-load processing ------------------------
    def _wrote(self, plan, step) -> None:
        self._touched.update(c.dst_key for c in plan.copies)
        if isinstance(step, _Restore):
            self._touched.update(storage_key(dst) for dst, _ in step.items)

    @contextmanager
    def batch(self):
        """vLLM's post-load processing (a kernel format built from the loader-format
        weights) runs once, at the end, for every layer the batch's applies wrote, not
        after each apply: the applies write only loader-format weights, so no layout is
        rebound in between."""
        self._batch_touched: set[int] | None = set()
        try:
            yield
            touched, self._batch_touched = self._batch_touched, None
            self._reprocess(touched)
        finally:
            self._batch_touched = None

    def apply(self, records: Sequence[Record]) -> UndoLog:
        self._touched: set[int] = set()
        log = super().apply(records)
        if getattr(self, "_batch_touched", None) is not None:
            self._batch_touched.update(self._touched)  # processed when the batch ends
            return log
        try:
            self._reprocess(self._touched)
        except BaseException as exc:
            try:
                self.revert(log)
            except Exception as undo_exc:
                raise ApplyError(f"re-processing failed ({exc}) and reverting failed too ({undo_exc}): "
                                 "runtime bits are inconsistent, reload from an anchor checkpoint") from exc
            raise
        return log

    def revert(self, log: UndoLog) -> None:
        self._touched = set()
        super().revert(log)
        for step in log.steps:
            if isinstance(step, _Restore):
                self._touched.update(storage_key(dst) for dst, _ in step.items)
        self._reprocess(self._touched)

    def _reprocess(self, touched: set[int]) -> None:
        """Re-run vLLM's `process_weights_after_loading` for every layer written."""
        layers = []
        for key in touched:
            layer = self._owner.get(key)
            if layer is not None and layer not in layers:
                layers.append(layer)
        if not layers:
            return
        t = time.perf_counter()
        for layer in layers:
            kept = self._kept.get(layer, {})
            before = {n: dtypes.bits_of(p.detach()).clone() for n, p in kept.items()}
            saved = []
            for name, p in kept.items():
                saved.append((name, layer._parameters.get(name)))
                layer._parameters[name] = p
            if hasattr(layer, "_already_called_process_weights_after_loading"):
                delattr(layer, "_already_called_process_weights_after_loading")
            try:
                with torch.no_grad():
                    layer.quant_method.process_weights_after_loading(layer)
            except BaseException:
                for name, live in saved:  # leave the previous kernel format in place
                    if live is not None:
                        layer._parameters[name] = live
                raise
            for name, p in kept.items():
                if layer._parameters.get(name) is p:  # processing kept the loader format
                    del self._kept[layer][name]
                if not torch.equal(dtypes.bits_of(p.detach()), before[name]):
                    raise ApplyError(f"{type(layer).__name__}.{name}: vLLM's post-load processing "
                                     "modified the loader-format weight in place")
            if hasattr(layer, "update_param_tp_status"):
                layer.update_param_tp_status()
            for t_ in list(layer._parameters.values()) + list(layer._buffers.values()):
                if t_ is not None:
                    self._owner[storage_key(t_)] = layer
        self._readback = None
        self.reprocess_s += time.perf_counter() - t

    # -- verification ------------------------------------------------------------------
    def loader_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer as the loaders wrote it (kept loader-format ones
        in place of the kernel format), by vLLM name: compare with a fresh load."""
        saved = self._swap_in()
        try:
            state = {n: t.detach() for n, t in self.model.state_dict(keep_vars=True).items()}
        finally:
            self._swap_out(saved)
        return state


class DCRWorkerExtension:
    """vLLM worker extension: a NeMo-DCR receiver inside each vLLM worker.

    Pass `worker_extension_cls="nemo_dcr.runtimes.vllm.DCRWorkerExtension"` to `LLM` /
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
                  holds_checkpoint: bool | None = None) -> dict:
        """Build the adapter on this worker's model and open a receiver end (`history`: a
        directory or "s3" to catch up from when behind or uncertain). `holds_checkpoint`:
        whether the engine loaded `checkpoint_dir` (default: unless its load format is
        "dummy"); one that did not is resynced densely by its first refit."""
        from nemo_dcr import registry
        from nemo_dcr.history import open_history
        from nemo_dcr.receiver import Receiver

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
        runtime = VLLMRuntime(self._dcr_model(), checkpoint_dir, full_coverage=tp == 1,
                              holds_checkpoint=holds_checkpoint)
        rid = receiver_id if tp == 1 else f"{receiver_id}-tp{rank}"
        key = None
        if key_env:
            value = os.environ.get(key_env)
            if not value:
                raise ApplyError(f"HMAC key variable {key_env} is not set in the worker")
            key = value.encode()
        wiring = registry.transport(transport, dict(transport_config))
        self._dcr_receiver = Receiver(rid, runtime, wiring.receiver(rid), version=version, key=key,
                                      history=open_history(history, wiring))
        return {"receiver_id": rid, "catalog": len(runtime.catalog()), "ignored": dict(runtime.ignored),
                "kept_loader_format": sorted(f"{type(m).__name__}.{n}" for m, ps in runtime._kept.items()
                                             for n in ps),
                "holds_checkpoint": holds_checkpoint, "state_digest": self._dcr_receiver.state_digest,
                "setup_s": time.perf_counter() - t}

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
                elif event.kind == "begin":
                    self._dcr_begun[event.meta["transfer"]["transfer_id"]] = time.time()
                try:
                    rx.handle(event)
                except Exception as exc:  # noqa: BLE001 - keep staging; the transfer fails on its own
                    _log.warning("nemo-dcr staging thread: %s event failed: %s: %s", event.kind,
                                 type(exc).__name__, exc)

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
                    self._dcr_begun[tid] = time.time()
                aborts_ours = kind == "abort" and tid not in self._dcr_done and (
                    tid in self._dcr_begun or (cur is not None and cur.info.transfer_id == tid))
                if cur is not None and kind in ("commit", "abort") and cur.info.transfer_id == tid:
                    out.update(transfer_id=tid, apply_s=cur.apply_s, stage_s=cur.stage_s)
                alive = rx.handle(event)
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
