"""torchrun worker: a Megatron GPT (BF16, distributed optimizer) trains and refits a
Megatron-inference job (tests/workers/megatron_receiver.py, its own torchrun job, one
receiver per inference rank) over the local transport.

After loading version 0 and after every step, rank 0 writes the trainer's dense export
(`tests/support/reference_export.py`) to --out as `trainer-v<N>.safetensors` and its
digests as `trainer-v<N>.json`; the test compares them with what the inference job
writes. Each step rank 0 also checks the receivers' own verify replies: every tensor
an inference rank holds whole (the only ones its digests list) equals the export.
With --qkv-residual, fused QKV travels as a residual (recomputed q/k/v rows sent as
overwrites, the other tensors as --op records).
Prints "[megatron_trainer] OK".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--family", default="qwen3")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--op", default="xor", choices=["xor", "add", "overwrite"])
    ap.add_argument("--qkv-residual", action="store_true",
                    help="send fused QKV as a residual (recomputed q/k/v rows, overwrites)")
    ap.add_argument("--receivers", required=True)
    ap.add_argument("--transport-config", required=True)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from safetensors.torch import save_file
    from tests.support.reference_export import reference_export

    from nemo_dcr import registry
    from nemo_dcr.capture import megatron_owned_ranges
    from nemo_dcr.checkpoint import CheckpointReader
    from nemo_dcr.demo import harness as H
    from nemo_dcr.layout import LocalParam
    from nemo_dcr.records import Op
    from nemo_dcr.runtimes.megatron.load import load_into
    from nemo_dcr.runtimes.megatron.model import megatron_param_name_map
    from nemo_dcr.trainer import TrainerRefit
    from nemo_dcr.verify import state_digests

    H.init_distributed(args.tp, args.pp)
    rank = dist.get_rank()
    hf_config, specs, converter, layout = H.checkpoint_parts(args.checkpoint, args.family, args.qkv_residual)
    model, optimizer = H.build_trained_model(hf_config, args.tp, args.pp, lr=args.lr)
    params = megatron_param_name_map(model)
    local = [LocalParam(n, tuple(p.shape), p.dtype) for n, p in params.items()]
    load_into(params, converter.plan(local, layout, specs, loading=True), CheckpointReader(args.checkpoint).get)
    optimizer.reload_model_params()

    receivers = args.receivers.split(",")
    transport = registry.transport("local", json.loads(args.transport_config), receivers=receivers)
    refit = TrainerRefit(converter, specs, megatron_owned_ranges(optimizer, model), layout, transport,
                         state_dir=args.state_dir, op=Op(args.op), max_payload_elements=1 << 13, timeout_s=120)

    def publish(version: int) -> dict | None:
        dense = reference_export(model, hf_config, family=args.family)  # collective
        if rank != 0:
            return None
        save_file(dense, os.path.join(args.out, f"trainer-v{version}.safetensors"))
        digests = state_digests(dense)
        with open(os.path.join(args.out, f"trainer-v{version}.json"), "w") as f:
            json.dump(digests, f)
        return digests

    publish(0)
    batches = H.make_batches(hf_config.vocab_size, 16, micro_batch=2, num_micro=2, seed=100 + H.dp_rank(),
                             steps=args.steps)
    for step, batch in enumerate(batches, 1):
        ok, _ = H.train_step(model, optimizer, batch)
        assert ok, f"step {step}: optimizer step skipped"
        res = refit.refit()
        expected = publish(step)
        if rank == 0:
            assert res.decision.committed and res.decision.version == step, res.decision
            assert 0 < res.change_rate < 0.5, res.change_rate
            assert (res.residual_elements > 0) == args.qkv_residual, res.residual_elements
            replies = refit.coordinator.verify()
            assert sorted(replies) == sorted(receivers), replies.keys()
            whole = set()
            for rx, reply in sorted(replies.items()):
                assert reply["version"] == step, (rx, reply["version"])
                bad = [n for n, d in reply["digests"].items() if expected.get(n) != d]
                assert not bad, f"{rx}: {bad}"
                whole |= set(reply["digests"])
            m = res.metrics()
            print(f"[megatron_trainer] step {step}: changed {m['change_rate']:.2%} ({args.op}, "
                  f"{res.residual_elements} residual overwrites), "
                  f"{m['payloads']} payloads, "
                  f"{m['wire_bytes']} wire bytes, committed v{step}; whole-held digests match "
                  f"({len(whole)} tensors held whole by some inference rank)", flush=True)
    refit.close(shutdown_receivers=True)
    dist.barrier()
    if rank == 0:
        print("[megatron_trainer] OK", flush=True)
    H.shutdown()


if __name__ == "__main__":
    from tests.support.launch import run_worker

    run_worker(main)
