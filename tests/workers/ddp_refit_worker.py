"""torchrun worker: a plain PyTorch trainer (Hugging Face model under torch DDP, gloo,
AdamW in BF16) refits a receiver process; ownership of every parameter is split
evenly across the DP ranks. Rank 0 prints "[ddp_refit] OK" when every refit
committed and the receiver's digests equal the trainer's state after each step."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--transport-config", required=True)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    import json

    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM

    from nemo_dcr import registry
    from nemo_dcr.capture import attach_post_step_hook, torch_owned_ranges
    from nemo_dcr.checkpoint import read_specs
    from nemo_dcr.layout import ParallelLayout
    from nemo_dcr.trainer import TrainerRefit
    from nemo_dcr.verify import state_digests

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    transport = registry.transport("local", json.loads(args.transport_config), receivers=["rx0"])
    refit = TrainerRefit(registry.converter("identity", model.config), read_specs(args.checkpoint),
                         torch_owned_ranges(ddp, rank, world), ParallelLayout(dp_size=world, dp_rank=rank),
                         transport, state_dir=args.state_dir, max_payload_elements=2000,
                         encode_threads=2)  # many small payloads, encoded on two threads beside the diff
    results = []
    attach_post_step_hook(opt, lambda: results.append(refit.refit()))
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, model.config.vocab_size, (2, 16))
        ddp(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        res = results.pop()
        state = {k: v for k, v in model.state_dict().items() if k not in tied}
        mismatches = refit.verify(state_digests(state) if rank == 0 else None)
        if rank == 0:
            assert res.decision.committed and res.decision.version == step, res.decision
            assert res.changed_elements > 0
            assert mismatches == {"rx0": []}, mismatches
            print(f"[ddp_refit] step {step}: {res.change_rate:.2%} changed, {res.wire_bytes} wire bytes, "
                  f"{len(res.producers)} producers, bit-exact", flush=True)
    refit.close(shutdown_receivers=True)
    dist.barrier()
    if rank == 0:
        print("[ddp_refit] OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from tests.support.launch import run_worker

    run_worker(main)
