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
        self.policy: SharedExportRefit | None = None
        self.rollout: MirrorReceiver | None = None
        self.last_metrics: dict[str, float] = {}

    # -- set-up ------------------------------------------------------------------------

    def prepare(self) -> dict:
        return {"engine": "nemo_dcr", "transport": self.settings.transport, "pid": os.getpid()}

    def init_policy_process_group(self, *, worker_rank: int, train_world_size: int, rollout_world_size: int,
                                  metadata: list[Any]) -> None:
        if self.policy is not None:  # NeMo RL calls it again after finalize(): the refit state stays
            return
        self._check_peers(metadata)
        ensure_process_group(train_world_size)
        self.policy = SharedExportRefit(self.settings, worker_rank, train_world_size,
                                        rollout_receiver_ids(rollout_world_size))

    def init_rollout_process_group(self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int,
                                   metadata: list[Any]) -> None:
        if self.rollout is not None:
            return
        self._check_peers(metadata)
        receiver_id = rollout_receiver_ids(rollout_world_size)[rollout_rank]
        self.rollout = MirrorReceiver(self.settings, receiver_id, self.settings.build_transport())

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

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> dict[str, float]:
        """Every policy rank, collectively: one refit. Returns its metrics (complete on
        rank 0); raises when it did not commit."""
        if self.policy is None:
            raise RuntimeError("NeMo-DCR: send_weights before init_policy_process_group")
        self.last_metrics = self.policy.send(weights)
        return self.last_metrics

    async def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        if self.rollout is None:
            raise RuntimeError("NeMo-DCR: receive_weight_batches before init_rollout_process_group")
        for batch in self.rollout.update(self.bucket_size):
            yield batch
