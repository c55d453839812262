"""A Ray actor standing where NeMo RL's Megatron policy worker stands, built on NeMo RL's
own `PolicyCheckpointEngineMixin` and `MegatronCheckpointEngineSendMixin`.

Each actor is one Megatron rank (gloo, tensor parallel over all actors, the distributed
optimizer, AdamW), loaded from the version-0 Hugging Face checkpoint. Its weight iterator
exports the model the way NeMo RL's Megatron worker does: every rank yields every full
Hugging Face tensor, gathered across the TP ranks while the stream is read
(`tests/support/reference_export.py` assembles them on rank 0, which broadcasts each one).
"""

from __future__ import annotations

import os

from tests.support.nemo_rl_import import import_nemo_rl

import_nemo_rl()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from nemo_rl.models.policy.workers.checkpoint_engine import (  # noqa: E402
    MegatronCheckpointEngineSendMixin,
    PolicyCheckpointEngineMixin,
)


class MegatronPolicyWorker(MegatronCheckpointEngineSendMixin, PolicyCheckpointEngineMixin):
    def __init__(self, rank: int, world: int, master_port: int, checkpoint: str, lr: float):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(master_port))
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        from nemo_dcr import registry
        from nemo_dcr.checkpoint import CheckpointReader, read_specs
        from nemo_dcr.demo import harness as H
        from nemo_dcr.layout import LocalParam, ParallelLayout
        from nemo_dcr.runtimes.megatron.load import load_into
        from nemo_dcr.runtimes.megatron.model import megatron_param_name_map

        H.init_distributed(world, 1)
        self.rank = rank
        self.checkpoint = checkpoint
        self.cfg = {"model_name": checkpoint}  # the part of NeMo RL's policy config an engine reads
        self.hf_config = AutoConfig.from_pretrained(checkpoint)
        layout = ParallelLayout(tp_size=world, tp_rank=ps.get_tensor_model_parallel_rank(),
                                dp_size=H.dp_size(), dp_rank=H.dp_rank())
        self.model, self.optimizer = H.build_trained_model(self.hf_config, world, 1, lr=lr)
        params = megatron_param_name_map(self.model)
        converter = registry.converter(self.hf_config.model_type, self.hf_config)
        local = [LocalParam(n, tuple(p.shape), p.dtype) for n, p in params.items()]
        load_into(params, converter.plan(local, layout, read_specs(checkpoint), loading=True),
                  CheckpointReader(checkpoint).get)
        self.optimizer.reload_model_params()
        self.checkpoint_engine = None

    # -- what NeMo RL's Megatron worker provides to the send mixin ---------------------

    def _iter_params_with_optional_kv_scales(self, kv_scales=None):
        from nemo_dcr.trainer import bcast_json
        from tests.support.reference_export import reference_export

        dense = reference_export(self.model, self.hf_config)
        specs = bcast_json({n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in dense.items()}
                           if self.rank == 0 else None)
        for name, (dtype, shape) in specs.items():
            tensor = dense[name] if self.rank == 0 else torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(tensor, 0)
            yield name, tensor

    # -- the test's hands ----------------------------------------------------------------

    def train(self, tokens: list[list[int]]) -> float | None:
        from nemo_dcr.demo import harness as H

        ok, loss = H.train_step(self.model, self.optimizer, [torch.tensor(tokens, dtype=torch.int64)])
        assert ok, "optimizer step failed"
        return loss

    def save_export(self, out_dir: str) -> dict[str, str] | None:
        """Collective: the dense export as a Hugging Face checkpoint in `out_dir` (rank 0
        writes it) and its digests (rank 0)."""
        import shutil

        from safetensors.torch import save_file

        from nemo_dcr.verify import state_digests

        dense = dict(self._iter_params_with_optional_kv_scales())
        if self.rank != 0:
            return None
        os.makedirs(out_dir, exist_ok=True)
        save_file({k: v.contiguous() for k, v in dense.items()}, os.path.join(out_dir, "model.safetensors"))
        shutil.copy(os.path.join(self.checkpoint, "config.json"), out_dir)
        return state_digests(dense)

    def checkpoint_engine_metrics(self) -> dict:
        return dict(self.checkpoint_engine.last_metrics)

    def corrupt_next_payload(self) -> None:
        """Flip a bit in this rank's first payload of the next refit, on its way out."""
        from tests.support.faults import FaultyEnd

        producer = self.checkpoint_engine.policy.refit.producer
        producer.end = FaultyEnd(producer.end, {f"{producer.id}-000000": "corrupt"})

    def heal(self) -> dict:
        """Take the fault injector out again; what it injected."""
        from tests.support.faults import FaultyEnd

        producer = self.checkpoint_engine.policy.refit.producer
        if isinstance(producer.end, FaultyEnd):
            injected, producer.end = producer.end.injected, producer.end.inner
            return injected
        return {}

    def close(self) -> None:
        if self.checkpoint_engine is not None:
            self.checkpoint_engine.close(shutdown_receivers=self.rank == 0)
        from nemo_dcr.demo import harness as H

        H.shutdown()
