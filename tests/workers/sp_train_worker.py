"""torchrun worker: train under tensor + sequence parallelism on the local (non-TE) spec.

`--model qwen3_moe` (TP=2, EP=2 over the TP ranks, expert-TP 1) or `qwen3` (dense TP=2);
world size = tp (DP = 1). Megatron DDP + the distributed optimizer, as the harness builds
them. Checks, rank 0 printing "[sp_train] OK" when all pass:
1. the norms that see sequence-split activations (input / pre-MLP / final) are marked
   `sequence_parallel`, the q/k norms (TP-split heads, whole sequence) are not;
2. before training, the SP model's loss equals the loss of the same model built without
   SP (same seed, same batch): SP changes where tokens live, not what is computed;
3. `--steps` optimizer steps all succeed, every loss is finite and the loss decreases
   (one fixed batch);
4. afterwards every TP-replicated parameter (norms, q/k norms, router) has changed and is
   bit-identical on all TP ranks. Each rank normalises only its half of the sequence, so
   this holds only if the marked norms' grads are summed over TP.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist

TAG = "[sp_train]"


def replicated(name: str) -> bool:
    """Parameters every TP rank holds whole (under EP=TP the experts differ per rank)."""
    return "layernorm" in name or ".router." in name


@torch.no_grad()
def initial_loss(model, batch) -> float:
    (chunk,) = model
    chunk.eval()  # MoE at TP>1 without SP refuses only to train
    tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    loss = chunk(tokens, position_ids, None, labels=labels).float().mean().item()
    chunk.train()
    return loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["qwen3_moe", "qwen3"], required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    from nemo_dcr.demo import harness as H

    H.init_distributed(args.tp, 1, ep=args.ep, etp=1, timeout_s=120)
    from megatron.core import parallel_state as ps

    from nemo_dcr.runtimes.megatron.model import megatron_param_name_map
    from tests.workers.capture_worker import tiny_config
    from tests.workers.moe_logits_worker import tiny_moe_config

    cfg = tiny_moe_config(2, 4) if args.model == "qwen3_moe" else tiny_config("qwen3", 2)
    assert H.dp_size() == 1, "run with world size = tp"
    batch = H.make_batches(cfg.vocab_size, seq_len=16, micro_batch=2, num_micro=2, seed=5)

    plain, _ = H.build_trained_model(cfg, args.tp, 1, lr=1e-2, seed=11, ep=args.ep)
    model, opt = H.build_trained_model(cfg, args.tp, 1, lr=1e-2, seed=11, ep=args.ep, sequence_parallel=True)
    params = megatron_param_name_map(model)

    # (1)
    for name, p in params.items():
        want = name.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight", "final_layernorm.weight"))
        if "layernorm" in name:
            assert getattr(p, "sequence_parallel", False) == want, f"{name}: sequence_parallel should be {want}"
    # (2)
    sp_loss, plain_loss = initial_loss(model, batch[0]), initial_loss(plain, batch[0])
    assert abs(sp_loss - plain_loss) <= 1e-2 * abs(plain_loss), f"SP loss {sp_loss} vs without SP {plain_loss}"
    del plain

    before = {n: p.detach().clone() for n, p in params.items() if replicated(n)}
    assert any(".router." in n for n in before) == (args.model == "qwen3_moe")
    losses = []
    for step in range(args.steps):  # (3)
        ok, loss = H.train_step(model, opt, batch)
        assert ok, f"step {step}: optimizer step skipped"
        assert loss is not None and math.isfinite(loss), f"step {step}: loss {loss}"
        losses.append(loss)
    assert losses[-1] < losses[0], f"loss did not decrease: {losses}"

    tp_group = ps.get_tensor_model_parallel_group()
    for name, old in before.items():  # (4)
        now = params[name].detach()
        assert not torch.equal(now, old), f"{name}: unchanged by training"
        parts = [torch.empty_like(now, dtype=torch.float32) for _ in range(args.tp)]
        dist.all_gather(parts, now.float(), group=tp_group)  # bf16 -> fp32 is exact
        for r, other in enumerate(parts[1:], 1):
            diff = int((other.view(torch.int32) != parts[0].view(torch.int32)).sum())
            assert diff == 0, f"{name}: {diff} element(s) differ between TP ranks 0 and {r}"

    if dist.get_rank() == 0:
        print(f"{TAG} {args.model} tp={args.tp} ep={args.ep} sp=True: initial loss {sp_loss:.5f} "
              f"(without SP {plain_loss:.5f}), losses {[round(x, 4) for x in losses]}, "
              f"{len(before)} replicated params bit-identical over TP", flush=True)
        print(f"{TAG} OK", flush=True)
    H.shutdown()


if __name__ == "__main__":
    from tests.support.launch import run_worker

    run_worker(main)
