"""torchrun worker: a Megatron GPT (BF16, distributed optimizer) trains and refits a
receiver that holds the fine-grained FP8 version of its weights.

Version 0 is loaded from the BF16 checkpoint through the plain table; the refits go
through the FP8 table ("qwen3-fp8") against the FP8 checkpoint's catalog. After every
step rank 0 quantises the independent dense export (tests/support/reference_export.py)
with the test's loop-over-blocks reference quantiser and requires the receiver's digests
to equal it, FP8 weights, scales and BF16 tensors alike. Prints "[fp8_refit] OK"."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bf16", required=True, help="BF16 checkpoint: the trainer's version 0")
    ap.add_argument("--fp8", required=True, help="its FP8 version: what the receiver holds")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--transport-config", required=True)
    ap.add_argument("--state-dir", required=True)
    args = ap.parse_args()

    from megatron.core import parallel_state as ps
    from nemo_dcr.converters.llama import LlamaConverter
    from transformers import AutoConfig

    from nemo_dcr import registry
    from nemo_dcr.capture import megatron_owned_ranges
    from nemo_dcr.checkpoint import CheckpointReader, read_specs
    from nemo_dcr.converter import coverage_report, owned_intervals
    from nemo_dcr.demo import harness as H
    from nemo_dcr.layout import LocalParam, ParallelLayout
    from nemo_dcr.runtimes.megatron.load import load_into
    from nemo_dcr.runtimes.megatron.model import megatron_param_name_map
    from nemo_dcr.trainer import TrainerRefit, gather_json
    from nemo_dcr.verify import state_digests
    from tests.support.reference_export import reference_export
    from tests.test_fp8 import reference_fp8_state

    H.init_distributed(args.tp, 1)
    rank = dist.get_rank()
    hf_config = AutoConfig.from_pretrained(args.bf16)
    layout = ParallelLayout(tp_size=args.tp, tp_rank=ps.get_tensor_model_parallel_rank(),
                            dp_size=H.dp_size(), dp_rank=H.dp_rank())
    model, optimizer = H.build_trained_model(hf_config, args.tp, 1, lr=args.lr)
    params = megatron_param_name_map(model)
    local = [LocalParam(n, tuple(p.shape), p.dtype) for n, p in params.items()]
    load_into(params, LlamaConverter(hf_config).plan(local, layout, read_specs(args.bf16), loading=True),
              CheckpointReader(args.bf16).get)
    optimizer.reload_model_params()

    specs = read_specs(args.fp8)
    converter = registry.converter("qwen3-fp8", AutoConfig.from_pretrained(args.fp8))
    transport = registry.transport("local", json.loads(args.transport_config), receivers=["rx0"])
    refit = TrainerRefit(converter, specs, megatron_owned_ranges(optimizer, model), layout, transport,
                         state_dir=args.state_dir, max_payload_elements=1 << 15, timeout_s=120)
    covered = gather_json(owned_intervals(refit.producer.maps, refit.producer.owned))
    producing = gather_json(len(refit.producer.residuals))
    if rank == 0:
        report = coverage_report(specs, covered)
        fp8_bytes = sum(_nbytes(d, s) for n, (d, s) in specs.items() if d == "F8_E4M3" or n.endswith("_scale_inv"))
        assert (report.residual_bytes, report.unplaced) == (fp8_bytes, ()), report
        print(f"[fp8_refit] {report}; FP8 residuals produced per rank: {producing}", flush=True)

    batches = H.make_batches(hf_config.vocab_size, 16, micro_batch=2, num_micro=2, seed=100 + H.dp_rank(),
                             steps=args.steps)
    previous, moved = None, {"fp8": 0, "scale": 0}
    for step, batch in enumerate(batches, 1):
        ok, _ = H.train_step(model, optimizer, batch)
        assert ok, f"step {step}: optimizer step skipped"
        res = refit.refit()
        dense = reference_export(model, hf_config)  # collective
        expected = reference_fp8_state(dense) if rank == 0 else None
        mismatches = refit.verify(state_digests(expected) if rank == 0 else None)
        if rank == 0:
            assert res.decision.committed and res.decision.version == step, res.decision
            assert mismatches == {"rx0": []}, mismatches
            assert res.residual_elements > 0, "no FP8 element changed: the step did not exercise the residual"
            if previous is not None:  # how much of the FP8 state this step moved (scales included)
                moved["fp8"] += sum(_changed(expected[n], previous[n]) for n in expected if "_proj.weight" in n
                                    and not n.endswith("_scale_inv"))
                moved["scale"] += sum(_changed(expected[n], previous[n]) for n in expected
                                      if n.endswith("_scale_inv"))
            previous = expected
            print(f"[fp8_refit] step {step}: {res.change_rate:.2%} of owned elements changed, "
                  f"{res.residual_elements} FP8/scale overwrites, {res.wire_bytes} wire bytes, bit-exact",
                  flush=True)
    if rank == 0:
        assert moved["scale"] > 0, f"no block scale changed in {args.steps} steps: raise --lr ({moved})"
        print(f"[fp8_refit] FP8 elements / scales changed after step 1: {moved['fp8']} / {moved['scale']}",
              flush=True)
    refit.close(shutdown_receivers=True)
    dist.barrier()
    if rank == 0:
        print("[fp8_refit] OK", flush=True)
    H.shutdown()


def _nbytes(dtype_name, shape) -> int:
    from nemo_dcr.dtypes import from_name

    n = 1
    for s in shape:
        n *= s
    return n * from_name(dtype_name).itemsize


def _changed(a, b) -> int:
    from nemo_dcr.dtypes import bits_of

    return int((bits_of(a.contiguous()) != bits_of(b.contiguous())).sum())


if __name__ == "__main__":
    from tests.support.launch import run_worker

    run_worker(main)
