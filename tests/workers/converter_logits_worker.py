"""torchrun worker: load a Hugging Face checkpoint into Megatron shards *through the
converter* and compare with the HF model of that checkpoint.

Checks (rank 0 prints "[converter_logits] OK" when all pass):
1. an independent dense export of the loaded shards equals the checkpoint bit for bit;
2. Megatron's logits equal the HF transformers logits within bf16 tolerance.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.workers.capture_worker import check_logits, hf_model, tiny_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--checkpoint", required=True)
    args = ap.parse_args()

    from nemo_dcr.demo import harness as H
    from tests.support.reference_export import reference_export

    H.init_distributed(args.tp, args.pp, timeout_s=120)
    from megatron.core import parallel_state as ps

    from nemo_dcr import registry
    from nemo_dcr.checkpoint import CheckpointReader, read_specs
    from nemo_dcr.layout import LocalParam, ParallelLayout
    from nemo_dcr.runtimes.megatron.load import load_into
    from nemo_dcr.runtimes.megatron.model import megatron_param_name_map
    from nemo_dcr.verify import bit_mismatches

    hf_config = tiny_config(args.model, args.layers)
    if dist.get_rank() == 0:
        torch.manual_seed(3)
        ref = hf_model(hf_config)
        with torch.no_grad():  # HF initialises biases to 0, where a misplaced one goes unseen
            for name, p in ref.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.5)
        ref.save_pretrained(args.checkpoint)
    dist.barrier()

    model, _ = H.build_trained_model(hf_config, args.tp, args.pp, lr=1e-3, seed=99)  # weights overwritten below
    params = megatron_param_name_map(model)
    layout = ParallelLayout(tp_size=args.tp, tp_rank=ps.get_tensor_model_parallel_rank(),
                            pp_size=args.pp, pp_rank=ps.get_pipeline_model_parallel_rank(),
                            dp_size=H.dp_size(), dp_rank=H.dp_rank())
    converter = registry.converter(args.model.split("-")[0], hf_config)
    maps = converter.plan([LocalParam(n, tuple(p.shape), p.dtype) for n, p in params.items()], layout,
                          read_specs(args.checkpoint), loading=True)
    reader = CheckpointReader(args.checkpoint)
    load_into(params, maps, reader.get)

    export = reference_export(model, hf_config)
    canonical = reader.state_dict()
    if dist.get_rank() == 0:
        bad = bit_mismatches(canonical, export)
        assert not bad, f"dense export after loading differs from the checkpoint: {bad}"
    rel = check_logits(model, hf_config, canonical)
    if dist.get_rank() == 0:
        print(f"[converter_logits] tp={args.tp} pp={args.pp} model={args.model} "
              f"export bit-exact, logits rel err={rel}", flush=True)
        print("[converter_logits] OK", flush=True)
    H.shutdown()


if __name__ == "__main__":
    from tests.support.launch import run_worker

    run_worker(main)
