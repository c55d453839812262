"""The trainer side of `backend: "dcr"`, for any PyTorch trainer (plain, DDP, FSDP).

    from vllm.distributed.weight_transfer.base import ModuleSource
    from nemo_dcr.integrations.vllm.trainer import DCRTrainerInitInfo, DCRTrainerEngine, LLMClient

    info = DCRTrainerInitInfo(rank=0, transport="local", transport_config={"dir": "/dev/shm/run-1"})
    sync = DCRTrainerEngine.trainer_init(info, client=LLMClient(llm), source=ModuleSource(model))
    for batch in data:
        train_step(model, batch)
        sync.send_weights()          # only the changed bits; raises if vLLM did not commit

(`client`: vLLM's `HTTPVLLMWeightSyncClient` for `vllm serve`, its Ray client, or
`LLMClient` for an `LLM` in this process; a list of clients for several engines.
`source`: trainers that keep FP32 master weights pass `ServedDtypeSource(model)`, which
yields them as the BF16 tensors the engine serves.)

Every trainer rank runs `send_weights`; each keeps a disjoint share of every tensor the
source yields (`nemo_dcr.integrations.nemo_rl.shares`), diffs it against its committed
baseline and streams only the changes over the DCR transport; rank 0 drives vLLM's
update calls and the joint commit. The tensors must carry the served checkpoint's names
(a Hugging Face model's `named_parameters()` do; `ModuleSource` yields them).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    materialize_full_tensor,
)

from nemo_dcr.integrations.nemo_rl.config import ConfigError, DCRRefitConfig
from nemo_dcr.integrations.nemo_rl.shares import SharedExportRefit, ensure_process_group

log = logging.getLogger("nemo_dcr.vllm")


def receiver_ids(engines: int = 1, tensor_parallel_size: int = 1, prefix: str = "vllm") -> list[str]:
    """The receiver id of every vLLM worker: engine i is `<prefix><i>`, and under TP its
    workers are `<prefix><i>-tp<rank>` (as `engine.DCRWeightTransferEngine` names them)."""
    if tensor_parallel_size == 1:
        return [f"{prefix}{i}" for i in range(engines)]
    return [f"{prefix}{i}-tp{r}" for i in range(engines) for r in range(tensor_parallel_size)]


@dataclass
class DCRTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "dcr"
    transport: str = "local"
    transport_config: dict[str, Any] = field(default_factory=dict)
    tensor_parallel_size: int = 1  # of each vLLM engine (each worker is a receiver)
    key_env: str | None = None  # the environment variable holding the HMAC key, on both sides
    state_dir: str | None = None  # commit records (default: a fresh folder per run)
    op: str = "auto"
    timeout_s: float = 300.0
    max_attempts: int = 1  # one attempt per vLLM update call
    world_size: int = 1  # trainer ranks running send_weights (torch.distributed's default group)
    # Code records against the committed bits both ends hold (smaller under AdamW); every
    # vLLM worker then keeps a canonical host mirror of what it serves (docs/vllm.md).
    conditioned: bool = False


class ServedDtypeSource(ModuleSource):
    """A module's parameters as the engine serves them: cast to `dtype` (e.g. FP32 master
    weights sent as the BF16 checkpoint's tensors, rounded as `Tensor.to` rounds)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        super().__init__(module)
        self.dtype = dtype

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(m.name, self.dtype, m.shape) for m in super().metadata()]

    def __iter__(self):
        for name, param in self._module.named_parameters():
            yield name, materialize_full_tensor(param).detach().to(self.dtype)


class LLMClient:
    """vLLM's weight-sync client protocol over an offline `vllm.LLM` in this process."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


class DCRTrainerEngine(TrainerWeightTransferEngine[DCRTrainerInitInfo]):
    init_info_cls = DCRTrainerInitInfo

    def __init__(self, *, client, source, is_sender: bool, refit: SharedExportRefit):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.clients = list(client) if isinstance(client, (list, tuple)) else [client]
        self.refit = refit
        self.last_metrics: dict[str, float] = {}

    @classmethod
    def trainer_init(cls, init_info: DCRTrainerInitInfo, *, client, source=None) -> DCRTrainerEngine:
        if source is None:
            raise ValueError("backend 'dcr' needs the trainer's weights as a WeightSource (e.g. "
                             "ModuleSource(model)): it diffs them against the committed version")
        clients = list(client) if isinstance(client, (list, tuple)) else [client]
        block = {"transport": init_info.transport, init_info.transport: dict(init_info.transport_config),
                 "key_env": init_info.key_env, "state_dir": init_info.state_dir, "op": init_info.op,
                 "timeout_s": init_info.timeout_s, "max_attempts": init_info.max_attempts,
                 "conditioned": init_info.conditioned}
        settings = DCRRefitConfig.parse({k: v for k, v in block.items() if v is not None}, where="DCRTrainerInitInfo")
        if init_info.tensor_parallel_size < 1 or init_info.world_size < 1:
            raise ConfigError(["DCRTrainerInitInfo.tensor_parallel_size and world_size must be >= 1"])
        ensure_process_group(init_info.world_size)
        receivers = receiver_ids(len(clients), init_info.tensor_parallel_size)
        refit = SharedExportRefit(settings, init_info.rank, init_info.world_size, receivers)
        refit.establish(iter(source))  # the weights now are what the engines serve: version 0
        engine = cls(client=clients, source=source, is_sender=init_info.is_sender, refit=refit)
        if engine.is_sender:
            for i, c in enumerate(clients):
                c.init_weight_transfer_engine({
                    "transport": init_info.transport, "transport_config": dict(init_info.transport_config),
                    "receiver_id": f"vllm{i}", "key_env": init_info.key_env, "timeout_s": init_info.timeout_s,
                    "conditioned": settings.conditioned})
        return engine

    def send_weights(self) -> dict[str, float]:
        """Every trainer rank: one refit. Rank 0 runs vLLM's update round trip beside it
        (the engines apply and commit inside `finish_weight_update`). Returns the refit's
        metrics (complete on rank 0); raises `TransferFailed` when it did not commit, in
        which case every engine still serves the previous version."""
        threads, errors = [], []
        if self.is_sender:
            version = str(self.refit.refit.baseline.version + 1)

            def round_trip(c) -> None:
                try:
                    c.start_weight_update()
                    c.update_weights({})
                    c.finish_weight_update(version)
                except Exception as e:  # noqa: BLE001 - reported after the refit
                    errors.append(f"{type(e).__name__}: {e}")

            threads = [threading.Thread(target=round_trip, args=(c,), name="dcr-vllm-update") for c in self.clients]
            for t in threads:
                t.start()
        try:
            self.last_metrics = self.refit.send(iter(self.source))
        finally:
            for t in threads:
                t.join()
            for e in errors:
                log.error("nemo-dcr: vLLM's weight-update call failed: %s", e)
        if errors:
            raise RuntimeError("vLLM's weight-update calls failed: " + "; ".join(errors))
        return self.last_metrics

    def shutdown(self) -> None:
        self.refit.close(shutdown_receivers=False)
