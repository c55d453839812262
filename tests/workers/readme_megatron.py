"""torchrun worker: the README's Megatron block, exactly as printed, on two TP ranks.

Sets up what the block says a Megatron training script already has (parallel state, a
model and distributed optimizer loaded from the checkpoint, `train_step`, `work_dir`),
then executes the block. Rank 0 prints "[readme-megatron] OK" when it ran to its end.

    torchrun --nproc-per-node 2 tests/workers/readme_megatron.py CHECKPOINT WORK_DIR
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def main() -> None:
    import torch.distributed as dist
    from transformers import AutoConfig

    from nemo_dcr import registry
    from nemo_dcr.capture import megatron_layout
    from nemo_dcr.checkpoint import CheckpointReader, read_specs
    from nemo_dcr.demo import harness as H
    from nemo_dcr.layout import LocalParam
    from nemo_dcr.runtimes.megatron.load import load_into
    from nemo_dcr.runtimes.megatron.model import megatron_param_name_map
    from tests.test_readme import readme_block

    hf_checkpoint_dir, work_dir = sys.argv[1], sys.argv[2]
    H.init_distributed(tp=2, pp=1)
    hf_config = AutoConfig.from_pretrained(hf_checkpoint_dir)
    model, optimizer = H.build_trained_model(hf_config, 2, 1, lr=1e-3)
    params = megatron_param_name_map(model)
    local = [LocalParam(n, tuple(p.shape), p.dtype) for n, p in params.items()]
    maps = registry.converter(hf_config.model_type, hf_config).plan(local, megatron_layout(),
                                                                      read_specs(hf_checkpoint_dir), loading=True)
    load_into(params, maps, CheckpointReader(hf_checkpoint_dir).get)
    optimizer.reload_model_params()  # FP32 main params follow the loaded weights
    batches = iter(H.make_batches(hf_config.vocab_size, 16, micro_batch=2, num_micro=1, seed=1000, steps=3))

    def train_step(model, optimizer) -> None:
        ok, _ = H.train_step(model, optimizer, next(batches))
        assert ok, "the optimizer step was skipped"

    exec(readme_block("### Megatron"), {"hf_checkpoint_dir": hf_checkpoint_dir, "work_dir": work_dir,
                                         "model": model, "optimizer": optimizer, "train_step": train_step})
    if dist.get_rank() == 0:
        print("[readme-megatron] OK", flush=True)
    H.shutdown()


if __name__ == "__main__":
    from tests.support.launch import run_worker

    run_worker(main)
