"""torchrun worker: NeMo RL's Megatron policy workers, one per rank, with NeMo-DCR.

Each rank does what a NeMo RL Megatron policy worker does at set-up (Megatron model
chunks + the distributed optimizer, weights loaded from the HF checkpoint) and then
builds `DCRPolicyRefit.from_megatron_worker` from the validated
`policy.generation` config (--generation-config, a JSON file). Rank 0 takes commands
from the test on a ZeroMQ REP socket (--control) and broadcasts them to every rank,
as Ray would call every worker:

  {"op": "train", "tokens": [[ids]]}  one optimizer step on these sequences (rollouts)
  {"op": "stream"}                   stream_weights_via_dcr() -> {"ok", "metrics", "error"}
  {"op": "export"}                   digests of the dense export (tests/support/reference_export.py)
  {"op": "exit"}

Prints "[nemo_rl_policy] ready" once set up and "[nemo_rl_policy] OK" at exit.
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
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--generation-config", required=True)
    ap.add_argument("--receivers", required=True)
    ap.add_argument("--control", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args()

    import logging

    import zmq
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from nemo_dcr.checkpoint import CheckpointReader, read_specs
    from nemo_dcr.integrations.nemo_rl.config import from_generation_config
    from nemo_dcr.integrations.nemo_rl.policy import DCRPolicyRefit, RefitVerifyError
    from nemo_dcr.layout import LocalParam, ParallelLayout
    from nemo_dcr import registry
    from nemo_dcr.runtimes.megatron.load import load_into
    from nemo_dcr.runtimes.megatron.model import megatron_param_name_map
    from nemo_dcr.trainer import bcast_json
    from nemo_dcr.verify import state_digests
    from tests.support import mcore_harness as H
    from tests.support.reference_export import reference_export

    logging.basicConfig(level=logging.WARNING, format="[policy rank %(process)d] %(levelname)s %(message)s")
    with open(args.generation_config) as f:
        settings = from_generation_config(json.load(f))  # what NeMo RL validates at start-up

    H.init_distributed(args.tp, 1)
    rank = dist.get_rank()
    hf_config = AutoConfig.from_pretrained(args.checkpoint)
    layout = ParallelLayout(tp_size=args.tp, tp_rank=ps.get_tensor_model_parallel_rank(),
                            dp_size=H.dp_size(), dp_rank=H.dp_rank())
    model, optimizer = H.build_trained_model(hf_config, args.tp, 1, lr=args.lr)
    params = megatron_param_name_map(model)
    converter = registry.converter(settings.converter_name(hf_config), hf_config)
    local = [LocalParam(n, tuple(p.shape), p.dtype) for n, p in params.items()]
    load_into(params, converter.plan(local, layout, read_specs(args.checkpoint), loading=True),
              CheckpointReader(args.checkpoint).get)
    optimizer.reload_model_params()

    def dense_digests():
        dense = reference_export(model, hf_config)
        return state_digests(dense) if rank == 0 else None

    policy = DCRPolicyRefit.from_megatron_worker(settings, model, optimizer, hf_config, args.checkpoint, layout,
                                                 receivers=args.receivers.split(","),
                                                 expected_digests=dense_digests)
    sock = None
    if rank == 0:
        sock = zmq.Context.instance().socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(args.control)
        print("[nemo_rl_policy] ready", flush=True)
    while True:
        cmd = bcast_json(json.loads(sock.recv()) if rank == 0 else None)
        reply = {"ok": True}
        if cmd["op"] == "train":
            batch = [torch.tensor(cmd["tokens"], dtype=torch.int64)]
            ok, loss = H.train_step(model, optimizer, batch)
            reply = {"ok": ok, "loss": loss}
        elif cmd["op"] == "stream":
            try:
                ok = policy.stream_weights_via_dcr()
                reply = {"ok": ok, "metrics": policy.last_metrics, "error": policy.last_error,
                         "version": policy.version}
            except RefitVerifyError as exc:
                reply = {"ok": False, "raised": f"RefitVerifyError: {exc}", "version": policy.version}
        elif cmd["op"] == "export":
            reply = {"ok": True, "digests": dense_digests(), "version": policy.version}
        elif cmd["op"] == "exit":
            policy.close()
            if rank == 0:
                sock.send(json.dumps(reply).encode())
            break
        else:
            reply = {"ok": False, "error": f"unknown op {cmd['op']!r}"}
        if rank == 0:
            sock.send(json.dumps(reply).encode())
    dist.barrier()
    if rank == 0:
        sock.close()
        print("[nemo_rl_policy] OK", flush=True)
    H.shutdown()


if __name__ == "__main__":
    from tests.support.launch import run_worker

    run_worker(main)
