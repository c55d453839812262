"""torchrun worker: one life of a plain-PyTorch trainer (HF model under torch DDP, two
ranks) that refits a receiver process, for the crash-and-restart test.

--phase crash:   load the version-0 checkpoint, step + refit (v1 commits), step again,
                 save the weights (a trainer checkpoint, safetensors), then refit with
                 rank 0 dying right before the coordinator could commit v2.
--phase restart: load the saved weights, set up again on the same state and baseline
                 directories, refit: v2 must commit and the receiver must hold exactly
                 these weights. Prints "[restart] OK".
--phase refuse:  like restart but set up without baseline_dir: it must refuse, naming why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["crash", "restart", "refuse"], required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--weights", required=True, help="the trainer checkpoint saved before the crash")
    ap.add_argument("--transport-config", required=True)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--baseline-dir", required=True)
    args = ap.parse_args()

    from safetensors.torch import load_file, save_file
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM

    from nemo_dcr import registry
    from nemo_dcr.capture import torch_owned_ranges
    from nemo_dcr.checkpoint import read_specs
    from nemo_dcr.commit import Coordinator
    from nemo_dcr.errors import TransferFailed
    from nemo_dcr.layout import ParallelLayout
    from nemo_dcr.trainer import TrainerRefit
    from nemo_dcr.verify import state_digests

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if args.phase != "crash":
        with torch.no_grad():
            for name, t in load_file(args.weights).items():
                model.state_dict()[name].copy_(t)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    transport = registry.transport("local", json.loads(args.transport_config), receivers=["rx0"])

    def setup(**kw):
        return TrainerRefit(registry.converter("identity", model.config), read_specs(args.checkpoint),
                            torch_owned_ranges(ddp, rank, world), ParallelLayout(dp_size=world, dp_rank=rank),
                            transport, state_dir=args.state_dir, max_payload_elements=2000, timeout_s=60, **kw)

    def step():
        ids = torch.randint(0, model.config.vocab_size, (2, 16))
        ddp(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    def check(refit, version):
        state = {k: v for k, v in model.state_dict().items() if k not in tied}
        mismatches = refit.verify(state_digests(state) if rank == 0 else None)
        if rank == 0:
            assert mismatches == {"rx0": []}, mismatches
            print(f"[restart] receiver holds the trainer's weights at version {version}", flush=True)

    if args.phase == "refuse":
        try:
            setup()
        except TransferFailed as e:
            if rank == 0:
                print(f"[restart] refused: {e}", flush=True)
        else:
            raise AssertionError("set-up without the committed baseline did not refuse")
        dist.barrier()
        return
    refit = setup(baseline_dir=args.baseline_dir)
    if args.phase == "crash":
        step()
        assert refit.refit().decision.version == 1
        check(refit, 1)
        step()
        if rank == 0:
            save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}, args.weights)

            def die(self, *args, **kwargs):  # after every producer persisted its changes
                print("[restart] rank 0 dies before committing v2", flush=True)
                os._exit(17)
            Coordinator.finish = die
        dist.barrier()
        refit.refit()
        raise AssertionError("the coordinator should have died")
    # restart: baselines come back at v1 although the weights are v1 + one step
    assert refit.baseline.restored and refit.baseline.version == 1, refit.baseline.restore_note
    result = refit.refit()
    assert result.decision.committed and result.decision.version == 2
    assert rank != 0 or result.changed_elements > 0  # producer reports are gathered on rank 0
    check(refit, 2)
    refit.close(shutdown_receivers=True)
    dist.barrier()
    if rank == 0:
        print("[restart] OK", flush=True)


if __name__ == "__main__":
    from tests.support.launch import run_worker

    run_worker(main)
