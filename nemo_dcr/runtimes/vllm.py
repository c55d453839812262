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

The vLLM worker extension that hosts a receiver in every worker is
`nemo_dcr.integrations.vllm.worker_extension.DCRWorkerExtension`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from contextlib import contextmanager

import torch

from nemo_dcr import dtypes
from nemo_dcr.checkpoint import CheckpointReader, read_specs
from nemo_dcr.errors import ApplyError
from nemo_dcr.records import Record
from nemo_dcr.runtimes.base import Catalog, UndoLog
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_dcr.runtimes.intercept import NativeLoaderAdapter, RestoreBits
from nemo_dcr.runtimes.loader_trace import (StorageView, module_fingerprint, module_storages, mutated_tensors,
                                            storage_key)

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
                written = [storage_key(t) for t in mutated_tensors(func, args, kwargs) if t.numel()]
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
            if c.src == StorageView((), (), 0):
                raise ApplyError(f"{plan.name}: the loader transforms it; it cannot be read back")
            flat.as_strided(c.src.size, c.src.stride, c.src.offset).copy_(c.dst.detach())
        return t

    def _canonical_tensor(self, name: str) -> torch.Tensor:
        return self._assembled(self._readback_plans()[name])  # this tensor alone, not the whole state

    # -- apply / revert, then vLLM's own post-load processing ------------------------
    def _wrote(self, plan, step) -> None:
        self._touched.update(c.dst_key for c in plan.copies)
        if isinstance(step, RestoreBits):
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
            if isinstance(step, RestoreBits):
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
