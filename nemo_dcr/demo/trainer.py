"""End-to-end refit loop: a Megatron GPT trains under torchrun and refits rollout
receivers after every optimizer step, proving each receiver's whole state bit for bit.

`nemo-dcr demo` runs it (after creating the version-0 checkpoint and starting the
receivers); by hand, with receivers already serving that checkpoint:

    python -m torch.distributed.run --nproc-per-node 4 -m nemo_dcr.demo.trainer \\
        --checkpoint CKPT --tp 2 --receivers rx0,rx1 --state-dir STATE \\
        --transport-config '{"dir": "/dev/shm/my-job"}'

The loop, as a trainer of your own would write it: load version 0 through the family's
converter, set up `TrainerRefit` over the optimizer's owned shards, refit from the
optimizer's post-step hook, and check the receivers with `refit.verify()`: each one reads
its whole state again and must hold the producers' committed whole-state digest (no
gather of the model anywhere). On a machine without CUDA megatron-core runs through
`nemo_dcr.demo.megatron_cpu`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

# Keep the per-step report readable: megatron-core and torch.distributed warn about
# optional CUDA libraries and renamed collectives on every rank and every step.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|CUDA_DEVICE_MAX_CONNECTIONS).*")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m nemo_dcr.demo.trainer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="version-0 Hugging Face safetensors folder")
    p.add_argument("--family", default="qwen3", help="converter name (default: qwen3)")
    p.add_argument("--qkv-residual", action="store_true",
                   help="declare fused QKV as a residual rule (recomputed q/k/v rows sent as overwrites) "
                        "instead of affine pieces; receivers end with the same bits")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages (model chunks) per PP rank")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism for MoE families (expert-TP 1)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needed to train MoE with TP > 1)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--op", default="auto", choices=["auto", "xor", "add", "overwrite"],
                   help="how changes travel; auto: xor or add per tensor, whichever codes smaller")
    p.add_argument("--transport", default="local")
    p.add_argument("--transport-config", default="{}", help="JSON object")
    p.add_argument("--receivers", required=True, help="comma-separated receiver ids")
    p.add_argument("--state-dir", required=True, help="coordinator state (commit records)")
    p.add_argument("--max-payload-elements", type=int, default=1 << 16)
    p.add_argument("--encode-threads", type=int, default=0,
                   help="per rank: threads that encode payloads while the rank diffs on (default 0)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--results", help="write per-step results as JSON lines here (rank 0)")
    p.add_argument("--dump-dir", help="after the last step, each receiver dumps its full state here "
                                      "(<id>.safetensors) and rank 0 the committed version and its "
                                      "state digest (trainer.json)")
    p.add_argument("--shutdown-receivers", action="store_true")
    return p.parse_args(argv)


def last_stage_loss(loss: float | None) -> float:
    """The loss as the last pipeline stage computed it, on every rank."""
    t = torch.tensor([float("-inf") if loss is None else loss], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def residual_note(m: dict) -> str:
    n = m.get("residual_changed_elements", 0)
    return f" ({n} residual overwrites)" if n else ""


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    from nemo_dcr.demo import megatron_cpu

    megatron_cpu.install()  # before megatron-core is imported; nothing where CUDA is available
    from nemo_dcr import registry
    from nemo_dcr.capture import attach_post_step_hook, megatron_owned_ranges
    from nemo_dcr.checkpoint import CheckpointReader
    from nemo_dcr.converter import coverage_report, owned_intervals
    from nemo_dcr.demo import harness as H
    from nemo_dcr.errors import TransferFailed
    from nemo_dcr.layout import LocalParam
    from nemo_dcr.malloc import keep_freed_memory
    from nemo_dcr.runtimes.megatron.load import load_into
    from nemo_dcr.runtimes.megatron.model import megatron_param_name_map
    from nemo_dcr.trainer import TrainerRefit, gather_json

    H.init_distributed(args.tp, args.pp, vpp=args.vpp, ep=args.ep, etp=1 if args.ep > 1 else None)
    rank = dist.get_rank()
    hf_config, specs, converter, layout = H.checkpoint_parts(args.checkpoint, args.family, args.qkv_residual)
    vpp = f" (x{args.vpp} virtual)" if args.vpp else ""
    ep = f" EP={args.ep}" if args.ep > 1 else ""
    sp = " SP" if args.sp else ""
    log(f"[trainer] {dist.get_world_size()} ranks: TP={args.tp}{sp} PP={args.pp}{vpp} DP={H.dp_size()}{ep}, "
        f"distributed optimizer, BF16 params, Adam lr={args.lr}")

    t = time.perf_counter()
    extra = {"sequence_parallel": True} if args.sp else {}
    model, optimizer = H.build_trained_model(hf_config, args.tp, args.pp, lr=args.lr, vpp=args.vpp, ep=args.ep,
                                             **extra)
    params = megatron_param_name_map(model)
    local = [LocalParam(n, tuple(p.shape), p.dtype) for n, p in params.items()]
    load_maps = converter.plan(local, layout, specs, loading=True)
    load_into(params, load_maps, CheckpointReader(args.checkpoint).get)
    optimizer.reload_model_params()  # fp32 main params follow the loaded weights
    how = " (fused QKV as a residual)" if args.qkv_residual else ""
    log(f"[trainer] loaded version 0 from {args.checkpoint} through the {args.family} converter{how} "
        f"({time.perf_counter() - t:.1f} s)")

    transport = registry.transport(args.transport, json.loads(args.transport_config),
                                   receivers=args.receivers.split(","))
    owned = megatron_owned_ranges(optimizer, model)
    if args.encode_threads:
        keep_freed_memory()  # the encoding threads' malloc arenas would otherwise fault in every payload anew
    refit = TrainerRefit(converter, specs, owned, layout, transport, state_dir=args.state_dir,
                         op=args.op, max_payload_elements=args.max_payload_elements,
                         encode_threads=args.encode_threads)
    log(f"[trainer] placement checked: every canonical element has exactly one owner; "
        f"baseline {refit.baseline.nbytes / 2**20:.1f} MiB on this rank")
    # What the producers will actually send, over all ranks (each canonical byte counted once).
    covered = gather_json(owned_intervals(refit.producer.maps, refit.producer.owned))
    if rank == 0:
        print(f"[trainer] {coverage_report(specs, covered)}", flush=True)

    batches = H.make_batches(hf_config.vocab_size, args.seq_len, micro_batch=2,
                             num_micro=args.micro_batches, seed=1000 + H.dp_rank(), steps=args.steps)
    # Refit from the optimizer's post-step hook: it fires after every successful step.
    outcomes = []

    def refit_after_step():
        try:
            outcomes.append(refit.refit())
        except TransferFailed as e:
            outcomes.append(e)

    attach_post_step_hook(optimizer, refit_after_step)

    all_exact, results = True, []
    for step, batch in enumerate(batches, 1):
        t = time.perf_counter()
        ok, loss = H.train_step(model, optimizer, batch)  # the refit runs inside, after step()
        loss = last_stage_loss(loss)
        train_s = time.perf_counter() - t
        if not ok or not outcomes:
            log(f"step {step}: optimizer step skipped, nothing to refit")
            continue
        res = outcomes.pop()
        if isinstance(res, TransferFailed):
            log(f"step {step}: REFIT FAILED: {res}")
            all_exact = False
            break
        train_s -= res.seconds
        t = time.perf_counter()
        mismatches = refit.verify()  # rank 0: {receiver: problems}; each proves its whole state, no gather
        verify_s = time.perf_counter() - t
        if rank == 0:
            m = res.metrics()
            exact = bool(mismatches) and all(not bad for bad in mismatches.values())
            all_exact &= exact
            detail = "" if exact else f" {mismatches}"
            print(f"step {step} | loss {loss:.3f} | train {train_s:.1f} s | "
                  f"changed {m['change_rate']:.3%}{residual_note(m)} | dense {m['dense_bytes'] / 1e6:.2f} MB | "
                  f"wire {m['wire_bytes'] / 1e3:.1f} kB | ratio {m['compression']:.1f}x | "
                  f"refit {m['refit_s']:.2f} s | verify {verify_s:.1f} s | "
                  f"state digest {m['state_digest'][:12]} on {m['digest_checked_receivers']} receivers | "
                  f"bit-exact: {'yes' if exact else 'NO'} ({len(mismatches)} receivers){detail}", flush=True)
            results.append({"step": step, "bit_exact": exact, "mismatches": mismatches, **m})
    if args.dump_dir and rank == 0:  # for an offline check of every element (nemo-dcr demo --dump)
        os.makedirs(args.dump_dir, exist_ok=True)
        with open(os.path.join(args.dump_dir, "trainer.json"), "w") as f:
            json.dump({"version": refit.baseline.version, "state_digest": refit.state_digest}, f)
        refit.coordinator.verify(dump_dir=args.dump_dir)
    if rank == 0 and args.results:
        with open(args.results, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    refit.close(shutdown_receivers=args.shutdown_receivers)
    H.shutdown()
    return 0 if all_exact else 1


if __name__ == "__main__":
    sys.exit(main())
