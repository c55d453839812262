"""The worker side of `backend: "dcr"`: a NeMo-DCR receiver inside each vLLM worker.

vLLM builds one engine per worker with that worker's `model`, then drives it:

- `init_weight_transfer_engine(init_info)` opens the receiver on the configured DCR
  transport (`DCRInitInfo`) and starts staging in the background: from then on every
  transfer's payloads are decoded, authenticated and validated as they arrive, while the
  engine keeps generating; nothing is written.
- `start_weight_update()` and `update_weights(update_info)` write nothing either:
  `DCRUpdateInfo.expected_version` names the version the update must reach (default:
  the one after the served one).
- `finish_weight_update()` applies the staged changes in place through the model's own
  loader mapping (`runtimes.vllm.VLLMRuntime`) and takes part in the joint commit. A
  transfer that aborts, or is not decided within `timeout_s`, is reverted: the engine
  keeps serving v, and the trainer's refit raises.

Under vLLM TP each worker is its own receiver, `<receiver_id>-tp<rank>`, and applies what
its shard holds. With `DCRInitInfo.conditioned` (the trainer's `conditioned=True`) each
worker also keeps a canonical host mirror of the tensors it serves, read from the
checkpoint, that conditioned records are decoded against (docs/vllm.md). Refused with a clear error: pipeline parallelism, expert parallelism,
quantized models and draft-model updates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from nemo_dcr.errors import Unsupported
from nemo_dcr.integrations.vllm.worker_extension import DCRWorkerExtension

log = logging.getLogger("nemo_dcr.vllm")


@dataclass
class DCRInitInfo(WeightTransferInitInfo):
    """What `init_weight_transfer_engine` takes (as a JSON object)."""

    transport: str = "local"  # local | relay | s3, or any registered transport
    transport_config: dict[str, Any] = field(default_factory=dict)
    receiver_id: str = "vllm0"  # under TP: <receiver_id>-tp<rank>
    key_env: str | None = None  # the environment variable holding the HMAC key
    checkpoint_dir: str | None = None  # the canonical catalog's checkpoint (default: the served model's)
    timeout_s: float = 300.0  # how long finish_weight_update waits for the decision
    history: str | None = None  # a folder or "s3": deltas and anchors to catch up from
    # The trainer codes records against the committed bits (DCRTrainerInitInfo.conditioned):
    # each worker keeps a canonical host mirror of the tensors it serves, read from the
    # checkpoint (2 bytes a BF16 parameter, the whole tensors also under TP).
    conditioned: bool = False


@dataclass
class DCRUpdateInfo(WeightTransferUpdateInfo):
    """What `update_weights` takes: the version the update must reach (default: the next)."""

    expected_version: int | None = None


class _EngineHost(DCRWorkerExtension):
    """The worker extension's receiver machinery (staging thread, apply, commit) on the
    engine's model instead of a worker's."""

    def __init__(self, model: torch.nn.Module, vllm_config, rank: int):
        self._model, self.vllm_config, self.rank = model, vllm_config, rank
        self.parallel_config = vllm_config.parallel_config

    def _dcr_model(self) -> torch.nn.Module:
        return self._model


def refusals(vllm_config) -> list[str]:
    """What this engine does not support in `vllm_config` (empty when it can run)."""
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    out = []
    if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) > 1:
        out.append(f"pipeline parallelism (pipeline_parallel_size={parallel.pipeline_parallel_size}): a stage "
                   "holds a subset of the tensors, which the receiver does not model yet")
    if getattr(parallel, "enable_expert_parallel", False):
        out.append("expert parallelism (enable_expert_parallel): experts are spread over workers, which the "
                   "receiver does not model yet")
    if getattr(model, "quantization", None):
        out.append(f"quantized models (quantization={model.quantization!r}): their kernel formats are not the "
                   "checkpoint's; serve the BF16 checkpoint")
    return out


class DCRWeightTransferEngine(WeightTransferEngine[DCRInitInfo, DCRUpdateInfo]):
    init_info_cls = DCRInitInfo
    update_info_cls = DCRUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        problems = refusals(vllm_config)
        if problems:
            raise Unsupported("weight_transfer_config backend 'dcr' does not support " + "; ".join(problems))
        self.host: _EngineHost | None = None
        self.info: DCRInitInfo | None = None
        self.expected: int | None = None
        self.started: dict = {}
        self.last: dict = {}  # finish_weight_update's report: ok, reason, version, apply_s (the pause), ...

    def init_transfer_engine(self, init_info: DCRInitInfo) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        if not isinstance(init_info.conditioned, bool):
            raise ValueError(f"weight transfer backend 'dcr': init_info.conditioned must be true or false, got "
                             f"{init_info.conditioned!r}")
        if self.host is not None:  # a new trainer connection: the old receiver goes first
            self.host.dcr_close()
        self.host = _EngineHost(self.model, self.vllm_config, get_tensor_model_parallel_rank())
        self.info = init_info
        self.started = self.host.dcr_start(init_info.checkpoint_dir or self.model_config.model, init_info.transport,
                                           dict(init_info.transport_config), init_info.receiver_id,
                                           init_info.key_env, 0, init_info.history,
                                           conditioned=init_info.conditioned)
        self.host.dcr_background_start()
        log.info("nemo-dcr: receiver %s ready (%d canonical tensors)", self.started["receiver_id"],
                 self.started["catalog"])

    def _require(self) -> _EngineHost:
        if self.host is None:
            raise RuntimeError("weight transfer backend 'dcr': init_weight_transfer_engine was not called")
        return self.host

    def start_weight_update(self) -> None:
        self._require()
        self.expected = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # Nothing is written here (the background thread stages as payloads arrive), so
        # there is no device work to wait for, unlike the base class's copy engines.
        self.receive_weights(self.parse_update_info(update_info or {}))

    def receive_weights(self, update_info: DCRUpdateInfo) -> None:
        self._require()
        self.expected = update_info.expected_version

    def finish_weight_update(self) -> None:
        """Apply in place and commit jointly; on abort or time-out the engine keeps
        serving v (logged, and in `last`; the trainer's refit raises)."""
        host = self._require()
        self.last = host.dcr_update(self.expected, self.info.timeout_s)
        if not self.last.get("ok"):
            log.error("nemo-dcr: weight update to version %s not applied, still serving version %s: %s",
                      self.last.get("expected_version"), self.last.get("version"), self.last.get("reason"))

    def shutdown(self) -> None:
        if self.host is not None:
            self.host.dcr_close()
            self.host = None
