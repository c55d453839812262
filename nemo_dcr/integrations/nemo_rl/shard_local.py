"""The shard-local tier: capture from the distributed optimizer's owned shards, apply in place.

NeMo RL's plug-in interface hands the engine exported full tensors and loads what it
yields densely. With the small change to NeMo RL in
`patches/nemo-rl/checkpoint-engine-shard-local.patch`, NeMo RL's policy worker hands the
engine its Megatron model and optimizer, and its vLLM worker hands it the vLLM model.
Then:

- each policy rank diffs exactly what its distributed optimizer owns
  (`capture.megatron_owned_ranges`), in Megatron's own layout, mapped to canonical
  coordinates by the family's converter: no export, no gather, no share copy;
- each vLLM worker applies the changed bits in place through vLLM's own loader
  (`runtimes.vllm.VLLMRuntime`, reverted on abort): no host mirror, no dense load
  (unless `conditioned: true`: then each keeps a canonical host mirror of the tensors it
  serves, `nemo_dcr.mirror.CanonicalMirror`, that conditioned records decode against).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from nemo_dcr.integrations.nemo_rl.config import DCRRefitConfig
from nemo_dcr.integrations.nemo_rl.shares import commit_state_dir, refit_once
from nemo_dcr.integrations.nemo_rl.transfer_wait import UpdateFailed, finish_transfer

log = logging.getLogger("nemo_dcr.nemo_rl")


def local_checkpoint(model_name: str) -> Path:
    """The Hugging Face checkpoint folder of `model_name` (a path, or a hub id already in
    the local cache, where NeMo RL downloaded it): its safetensors headers are the
    canonical catalog."""
    from nemo_dcr.checkpoint import local_checkpoint as resolve

    return resolve(model_name)


class OwnedShardRefit:
    """One Megatron policy rank's refit over what its optimizer owns (collective set-up)."""

    def __init__(self, settings: DCRRefitConfig, model, optimizer, model_name: str, receivers: list[str]):
        from transformers import AutoConfig

        from nemo_dcr import registry
        from nemo_dcr.capture import megatron_layout, megatron_owned_ranges
        from nemo_dcr.checkpoint import read_specs
        from nemo_dcr.trainer import TrainerRefit

        s = self.settings = settings
        checkpoint = local_checkpoint(model_name)
        hf_config = AutoConfig.from_pretrained(checkpoint)
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        converter = registry.converter(s.converter or hf_config.model_type, hf_config, **s.converter_options)
        self.owned = megatron_owned_ranges(optimizer, chunks)
        self.transport = s.build_transport(receivers)
        import torch.distributed as dist

        state_dir = commit_state_dir(s, dist.get_rank())
        self.refit = TrainerRefit(converter, read_specs(checkpoint), self.owned, megatron_layout(), self.transport,
                                  state_dir=state_dir, op=s.op, key=s.key(), timeout_s=s.timeout_s,
                                  max_payload_elements=s.max_payload_elements, encode_threads=s.encode_threads,
                                  wire_version=s.wire_version, max_attempts=s.max_attempts,
                                  state_digest=s.state_digest, conditioned=s.conditioned, log=log.warning)
        self.refits = 0

    def send(self) -> dict:
        """Collective: one refit of the owned shards as they are now."""
        self.refits += 1
        metrics = refit_once(self.refit, self.refits)
        owned_bytes = sum(r.tensor.numel() * r.tensor.element_size() for r in self.owned)
        metrics.update(export_read_s=0.0, export_read_bytes=0.0, export_stream_bytes=0.0,
                       owned_read_bytes=float(owned_bytes))
        return metrics

    def close(self, shutdown_receivers: bool = False) -> None:
        self.refit.close(shutdown_receivers=shutdown_receivers)


class InPlaceReceiver:
    """One vLLM worker's receiver writing into the served model (id `rollout<rank>`)."""

    def __init__(self, settings: DCRRefitConfig, receiver_id: str, transport, model: torch.nn.Module,
                 model_name: str, *, tensor_parallel: int = 1, holds_checkpoint: bool = False):
        from nemo_dcr.receiver import Receiver
        from nemo_dcr.runtimes.scatter import default_threads
        from nemo_dcr.runtimes.vllm import VLLMRuntime

        self.settings, self.id = settings, receiver_id
        self.end = transport.receiver(receiver_id)
        checkpoint = local_checkpoint(model_name)
        runtime = VLLMRuntime(model, checkpoint, full_coverage=tensor_parallel == 1,
                              holds_checkpoint=holds_checkpoint)
        self.mirror = None
        if settings.conditioned and not getattr(runtime, "canonical_layout", False):
            # vLLM's weights are fused, repacked and sharded: conditioned records decode
            # against a canonical host copy of what this worker serves, from the checkpoint
            # (an engine on dummy weights is resynced densely first, which moves it too).
            from nemo_dcr.mirror import CanonicalMirror

            self.mirror = CanonicalMirror.from_checkpoint(checkpoint, names=runtime.catalog())
            log.info("[%s] canonical mirror of %d tensors from %s for conditioned coding: %.1f MiB of host memory",
                     receiver_id, len(self.mirror), checkpoint, self.mirror.nbytes / 2**20)
        # Every TP worker decodes every record: the host's cores are shared among them.
        self.receiver = Receiver(receiver_id, runtime, self.end, key=settings.key(),
                                 state_digest=settings.state_digest, log=log.info, mirror=self.mirror,
                                 decode_threads=default_threads(tensor_parallel, cap=None))
        self.last: dict = {}

    def update(self) -> bool:
        """Take the next transfer to its end, applied in place. Raises UpdateFailed
        (after the receiver reverted what it applied) when it did not commit."""
        t0 = time.perf_counter()
        rx = self.receiver
        version = rx.serving_version
        done = finish_transfer(lambda: rx, self.end, self.id, self.settings.timeout_s, self._ignore)
        self.last = {"version": rx.serving_version, "previous_version": version, "resyncs": rx.resyncs,
                     "update_s": time.perf_counter() - t0, "stage_s": done.stage_s, "apply_s": done.apply_s,
                     "load_s": 0.0}
        return True

    @staticmethod
    def _ignore(event) -> None:
        event.release()  # the runtime has its own catalog

    def close(self) -> None:
        self.end.close()


__all__ = ["OwnedShardRefit", "InPlaceReceiver", "UpdateFailed", "local_checkpoint"]
