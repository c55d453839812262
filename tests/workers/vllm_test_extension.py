"""Test hooks on top of `DCRWorkerExtension`, loaded into the vLLM worker by qualname.

They change how one parameter's vLLM weight loader behaves (vLLM's own extension
point, `param.weight_loader`) and apply hand-made records directly, so the tests can
check what fails closed. Nothing here is shipped."""

from __future__ import annotations

import numpy as np
import torch

from nemo_dcr import dtypes
from nemo_dcr.errors import ApplyError
from nemo_dcr.records import Op, Record
from nemo_dcr.integrations.vllm.worker_extension import DCRWorkerExtension


def _loader_param(runtime, name: str) -> torch.nn.Parameter:
    """The parameter vLLM's loader writes for `name` (the kept loader-format one if any)."""
    module_name, _, pname = name.rpartition(".")
    layer = runtime.model.get_submodule(module_name)
    kept = runtime._kept.get(layer, {}).get(pname)
    return kept if kept is not None else getattr(layer, pname)


class DCRTestExtension(DCRWorkerExtension):
    def dcr_test_wrap_loader(self, param_name: str, kind: str) -> None:
        runtime = self._dcr_receiver.runtime
        param = _loader_param(runtime, param_name)
        real = param.weight_loader
        self._dcr_wrapped = getattr(self, "_dcr_wrapped", [])
        self._dcr_wrapped.append((param, real))

        def loader(p, w, *args, **kwargs):
            if kind == "cast":  # the loaded weight goes through float32 first
                return real(p, w.float(), *args, **kwargs)
            if kind == "scale2":  # a value-changing transform
                return real(p, w * 2, *args, **kwargs)
            if kind == "twice":  # every element copied twice: a delta would land twice
                real(p, w, *args, **kwargs)
                return real(p, w, *args, **kwargs)
            if kind == "skip":
                return None
            if kind == "zero_first":  # a non-copy write into the parameter
                p.data.zero_()
                return real(p, w, *args, **kwargs)
            raise ValueError(kind)

        param.weight_loader = loader

    def dcr_test_unwrap_loaders(self) -> None:
        for param, real in reversed(getattr(self, "_dcr_wrapped", [])):
            param.weight_loader = real
        self._dcr_wrapped = []

    def dcr_test_apply(self, changes: list[dict], op: str) -> dict:
        """Apply records that set `changes` ([{name, positions, bits}]) with `op`; keep the log."""
        runtime = self._dcr_receiver.runtime
        catalog = runtime.catalog()
        state = runtime.canonical_state()
        records = []
        for ch in changes:
            name = ch["name"]
            dtype, shape = catalog[name]
            d = dtypes.from_name(dtype)
            pos = np.asarray(ch["positions"], dtype=np.uint64)
            new = np.asarray(ch["bits"], dtype=d.bits_numpy)
            old = dtypes.bits_of(state[name].detach()).contiguous().view(-1).numpy().view(d.bits_numpy)[pos]
            vals = {"xor": old ^ new, "add": new - old, "overwrite": new}[op]
            records.append(Record(name, dtype, shape, Op(op), pos, vals.astype(d.bits_numpy)))
        try:
            self._dcr_log = runtime.apply(records)
        except ApplyError as exc:
            return {"error": str(exc)}
        return {"error": None, "dense": sum(not isinstance(s, Record) for s in self._dcr_log.steps)}

    def dcr_test_revert(self) -> None:
        self._dcr_receiver.runtime.revert(self._dcr_log)

    def dcr_test_ensure_started(self, checkpoint_dir: str) -> None:
        if getattr(self, "_dcr_receiver", None) is None:
            import tempfile

            self.dcr_start(checkpoint_dir, "local", {"dir": tempfile.mkdtemp(), "timeout_s": 5}, "rx-test")

    def dcr_test_weight_replaced(self, layers: list[str]) -> dict:
        """Per layer, whether vLLM's post-load processing replaced its live `weight` with an
        empty tensor (its CPU kernels then hold a prepacked copy: oneDNN, AMX/VNNI), read
        from the model itself rather than from the adapter's bookkeeping."""
        model = self._dcr_model()
        return {n: model.get_submodule(n).weight.numel() == 0 for n in layers}

    def dcr_test_where(self, names: list[str]) -> dict:
        """Where vLLM's loader puts each canonical tensor: [[destination, element offset]]."""
        plans = self._dcr_receiver.runtime._plan(set(names))
        return {n: [[c.where, c.dst_view.offset] for c in plans[n].copies] for n in names}

    def dcr_test_try_runtime(self, checkpoint_dir: str) -> str | None:
        from nemo_dcr.runtimes.vllm import VLLMRuntime

        try:
            VLLMRuntime(self._dcr_model(), checkpoint_dir)
        except ApplyError as exc:
            return str(exc)
        return None
