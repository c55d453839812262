"""torchrun worker: a Megatron-inference job refitted in place, one receiver per rank.

Each rank builds its Megatron GPT chunk for the inference layout (--tp x --pp, not the
trainer's), loads version 0 through the converter's loading plan and serves as receiver
"mx<rank>" (`MegatronRuntime`, a subset catalog: records of tensors the rank does not
hold are validated and skipped). After version 0 and after every commit, all ranks
take a dense export of the inference model together (`tests/support/reference_export.py`,
which also checks that TP replicas and the last stage's tied embedding copy agree bit
for bit) and rank 0 writes its digests to --out as `inference-v<N>.json`; every rank
writes its held canonical slices' digests as `slices-mx<rank>-v<N>.json`. Runs until the
trainer shuts the receivers down; prints "[megatron_receiver] OK".

--qkv-residual-stages: the ranks of these PP stages load fused QKV through the residual
rule (a transformed value: q/k/v records must be overwrites, applied by the engine's
verified dense overwrite on the rank's TP shard), the others through the affine table.
Each rank picks its own loader; both must end with the trainer's bits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--family", default="qwen3")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--qkv-residual-stages", default="",
                    help="comma-separated PP stages whose ranks load fused QKV through the residual rule (its "
                         "inverse: records for q/k/v must be overwrites); the others use the affine table")
    ap.add_argument("--transport-config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline-s", type=float, default=600.0)
    args = ap.parse_args()

    from transformers import AutoConfig

    from tests.support.reference_export import reference_export

    from nemo_dcr import registry
    from nemo_dcr.checkpoint import CheckpointReader, read_specs
    from nemo_dcr.demo import harness as H
    from nemo_dcr.receiver import Receiver
    from nemo_dcr.runtimes.megatron import build_model_chunks, transformer_config_from_hf
    from nemo_dcr.runtimes.megatron.receiver import MegatronRuntime
    from nemo_dcr.verify import state_digests

    H.init_distributed(args.tp, args.pp)
    rank = dist.get_rank()
    hf_config = AutoConfig.from_pretrained(args.checkpoint)
    chunks = build_model_chunks(hf_config, transformer_config_from_hf(hf_config, tp=args.tp, pp=args.pp))
    for chunk in chunks:
        chunk.eval()
    from megatron.core import parallel_state as ps

    residual_stages = {int(x) for x in args.qkv_residual_stages.split(",") if x}
    options = {"qkv_as_residual": True} if ps.get_pipeline_model_parallel_rank() in residual_stages else {}
    runtime = MegatronRuntime(chunks, registry.converter(args.family, hf_config, **options),
                              read_specs(args.checkpoint))
    runtime.load_checkpoint(CheckpointReader(args.checkpoint).get)
    rx_id = f"mx{rank}"
    end = registry.transport("local", json.loads(args.transport_config)).receiver(rx_id)
    receiver = Receiver(rx_id, runtime, end, canonical_catalog=runtime.canonical_catalog,
                        log=lambda m: print(m, flush=True))
    qkv = "residual" if options else "affine"
    print(f"[{rx_id}] TP {runtime.layout.tp_rank}/{args.tp} PP {runtime.layout.pp_rank}/{args.pp}: holds "
          f"{len(runtime.held)} of {len(runtime.specs)} canonical tensors ({len(runtime.whole)} whole), "
          f"fused QKV {qkv}", flush=True)

    def publish(version: int) -> None:
        dense = reference_export(chunks, hf_config, family=args.family)  # collective over the inference ranks
        with open(os.path.join(args.out, f"slices-{rx_id}-v{version}.json"), "w") as f:
            json.dump(runtime.slice_digests(), f)
        if rank == 0:
            with open(os.path.join(args.out, f"inference-v{version}.json"), "w") as f:
                json.dump(state_digests(dense), f)

    publish(0)
    version, deadline = 0, time.monotonic() + args.deadline_s
    try:
        while time.monotonic() < deadline:
            event = end.poll(0.05)
            if event is None:
                continue
            if not receiver.handle(event):
                break
            if receiver.serving_version != version:  # a commit: every rank reaches it, in order
                version = receiver.serving_version
                publish(version)
        else:
            raise TimeoutError(f"{rx_id}: no shutdown within {args.deadline_s} s (at version {version})")
    finally:
        end.close()
    print(f"[{rx_id}] shut down at version {version}", flush=True)
    dist.barrier()
    if rank == 0:
        print("[megatron_receiver] OK", flush=True)
    H.shutdown()


if __name__ == "__main__":
    from tests.support.launch import run_worker

    run_worker(main)
