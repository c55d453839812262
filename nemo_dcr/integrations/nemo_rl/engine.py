"""`DCRCheckpointEngine`: NeMo-DCR behind NeMo RL's checkpoint-engine interface.

Enabled by configuration alone, in an unmodified NeMo RL (non-colocated vLLM):

    policy.generation.refit_transport: "nemo_dcr.integrations.nemo_rl:DCRCheckpointEngine"
    policy.generation.refit_cfg["nemo_dcr.integrations.nemo_rl:DCRCheckpointEngine"]:
        transport: local | relay | s3, and that transport's section (see config.py)

NeMo RL builds one engine in every policy worker and one in every vLLM worker
(`create_checkpoint_engine`), then drives them from `CheckpointEngineWeightSynchronizer`:
`prepare` and `init_*_process_group` once, then per refit `send_weights` on every policy
rank beside `receive_weight_batches` on every vLLM worker.

- Policy ranks (`shares.SharedExportRefit`): each keeps a disjoint share of the exported
  tensors, diffs it against its committed baseline and sends only the changed bits;
  rank 0 coordinates the joint commit. A refit that does not commit raises, so NeMo RL's
  `sync_weights` raises.
- vLLM workers (`mirror.MirrorReceiver`): each applies the changes to a canonical host
  mirror and, only after the joint commit, yields the tensors that changed to vLLM's
  loader. Otherwise nothing is yielded and the update raises: vLLM keeps serving v.
- The first refit of a run resyncs every vLLM worker densely (their mirrors start empty,
  and vLLM starts on dummy weights); later refits send only changes.

With `shard_local: true` and NeMo RL patched (patches/nemo-rl/), the workers hand the
engine their models (`attach_policy_model`, `attach_rollout_model`): policy ranks then
refit what their optimizer owns with no export, and vLLM workers apply in place
(`update_in_place`) with no mirror and no dense load (`shard_local.py`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch
from nemo_rl.utils.checkpoint_engines.base import CheckpointEngine

from nemo_dcr.integrations.nemo_rl.config import DCRRefitConfig
from nemo_dcr.integrations.nemo_rl.mirror import MirrorReceiver
from nemo_dcr.integrations.nemo_rl.shares import SharedExportRefit, ensure_process_group, rollout_receiver_ids

log = logging.getLogger("nemo_dcr.nemo_rl")

PATCH = "patches/nemo-rl/checkpoint-engine-shard-local.patch"


class DCRCheckpointEngine(CheckpointEngine):
    """One process's end of NeMo-DCR refits (a policy rank or a vLLM worker).

    bucket_size: NeMo RL's transfer bucket; here, the most bytes yielded to vLLM's loader
    in one batch. The other keyword arguments are the `refit_cfg` block
    (`DCRRefitConfig`); a bad one raises `ConfigError` naming each field.
    """

    def __init__(self, *, bucket_size: int, **settings: Any):
        self.settings = DCRRefitConfig.parse(settings)
        if int(bucket_size) < 1:
            raise ValueError(f"bucket_size must be positive, got {bucket_size!r}")
        self.bucket_size = int(bucket_size)
        self.policy = None  # SharedExportRefit, or shard_local.OwnedShardRefit
        self.rollout = None  # MirrorReceiver, or shard_local.InPlaceReceiver
        self.last_metrics: dict[str, float] = {}
        self._policy_model: dict | None = None  # what a patched NeMo RL hands over (shard_local)
        self._rollout_model: dict | None = None

    # -- the shard-local tier's hooks (called by a patched NeMo RL) ---------------------

    @property
    def reads_policy_shards(self) -> bool:
        """Policy workers hand over model and optimizer; send_weights gets no export."""
        return self.settings.shard_local

    @property
    def applies_in_place(self) -> bool:
        """vLLM workers hand over their model; `update_in_place` replaces the yielded batches."""
        return self.settings.shard_local

    def attach_policy_model(self, *, model: Any, optimizer: Any, config: dict) -> None:
        self._policy_model = {"model": model, "optimizer": optimizer, "model_name": config["model_name"]}

    def attach_rollout_model(self, *, model: torch.nn.Module, vllm_config: Any) -> None:
        load_format = getattr(vllm_config.load_config, "load_format", "auto")
        self._rollout_model = {"model": model, "model_name": vllm_config.model_config.model,
                               "tensor_parallel": int(vllm_config.parallel_config.tensor_parallel_size),
                               "holds_checkpoint": str(getattr(load_format, "value", load_format)) != "dummy"}

    def _unpatched(self, side: str) -> RuntimeError:
        return RuntimeError(f"NeMo-DCR: shard_local: true, but NeMo RL's {side} did not hand the engine its model: "
                            f"apply {PATCH} to NeMo RL, or set shard_local: false")

    # -- set-up ------------------------------------------------------------------------

    def prepare(self) -> dict:
        return {"engine": "nemo_dcr", "transport": self.settings.transport, "pid": os.getpid()}

    def init_policy_process_group(self, *, worker_rank: int, train_world_size: int, rollout_world_size: int,
                                  metadata: list[Any]) -> None:
        if self.policy is not None:  # NeMo RL calls it again after finalize(): the refit state stays
            return
        self._check_peers(metadata)
        ensure_process_group(train_world_size)
        receivers = rollout_receiver_ids(rollout_world_size)
        if not self.settings.shard_local:
            self.policy = SharedExportRefit(self.settings, worker_rank, train_world_size, receivers)
            return
        if self._policy_model is None:
            raise self._unpatched("policy worker")
        from nemo_dcr.integrations.nemo_rl.shard_local import OwnedShardRefit

        self.policy = OwnedShardRefit(self.settings, receivers=receivers, **self._policy_model)

    def init_rollout_process_group(self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int,
                                   metadata: list[Any]) -> None:
        if self.rollout is not None:
            return
        self._check_peers(metadata)
        receiver_id = rollout_receiver_ids(rollout_world_size)[rollout_rank]
        if not self.settings.shard_local:
            self.rollout = MirrorReceiver(self.settings, receiver_id, self.settings.build_transport())
            return
        if self._rollout_model is None:
            raise self._unpatched("vLLM worker")
        from nemo_dcr.integrations.nemo_rl.shard_local import InPlaceReceiver

        self.rollout = InPlaceReceiver(self.settings, receiver_id, self.settings.build_transport(),
                                       **self._rollout_model)

    @staticmethod
    def _check_peers(metadata: list[Any]) -> None:
        others = [m for m in metadata if not (isinstance(m, dict) and m.get("engine") == "nemo_dcr")]
        if others:
            raise RuntimeError(f"NeMo-DCR: {len(others)} peer(s) run another checkpoint engine ({others[0]!r}): "
                               f"every policy and vLLM worker must use the same refit_transport")

    def finalize(self) -> None:
        """Nothing to release between refits: the baselines, mirrors and transport ends
        are what the next refit diffs against (NeMo RL calls this after every refit with
        `release_after_refit: true`). `close()` ends them."""

    def close(self, shutdown_receivers: bool = False) -> None:
        """End this process's part: the policy's coordinator (rank 0) and producer ends,
        or the vLLM worker's receiver end."""
        if self.policy is not None:
            self.policy.close(shutdown_receivers=shutdown_receivers)
            self.policy = None
        if self.rollout is not None:
            self.rollout.close()
            self.rollout = None

    # -- refits ------------------------------------------------------------------------

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None] | None
                           ) -> dict[str, float]:
        """Every policy rank, collectively: one refit. Returns its metrics (complete on
        rank 0); raises when it did not commit. `weights`: NeMo RL's export (None in the
        shard-local tier, where the owned shards are read in place)."""
        if self.policy is None:
            raise RuntimeError("NeMo-DCR: send_weights before init_policy_process_group")
        self.last_metrics = self.policy.send() if self.settings.shard_local else self.policy.send(weights)
        return self.last_metrics

    async def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        if self.rollout is None:
            raise RuntimeError("NeMo-DCR: receive_weight_batches before init_rollout_process_group")
        if self.settings.shard_local:
            raise self._unpatched("vLLM worker")
        for batch in self.rollout.update(self.bucket_size):
            yield batch
        self.last_metrics = dict(self.rollout.last)

    def update_in_place(self) -> bool:
        """The shard-local tier's vLLM update: apply the next transfer into the model."""
        if not self.settings.shard_local or self.rollout is None:
            raise RuntimeError("NeMo-DCR: update_in_place needs shard_local: true and a patched NeMo RL")
        ok = self.rollout.update()
        self.last_metrics = dict(self.rollout.last)
        return ok
