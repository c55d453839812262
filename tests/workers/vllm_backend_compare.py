"""The same deltas into the same vLLM engine, two ways (run with the vLLM venv's python):
NeMo-DCR's `dcr` weight-transfer backend, and a dense `load_weights` of the new
weights (vLLM's own sparse path, `sparse_nccl`, needs NCCL and does not run on CPU).

    python -m tests.workers.vllm_backend_compare --model DIR --out FILE [--rates 0.01,0.03] [--rounds 3]

Per rate and round, the trainer-side model (the checkpoint's weights) gets ±1-ULP steps
on that share of every tensor's elements; the engine then takes them
- through `dcr`: `DCRTrainerEngine.send_weights` (local transport); measured: the bytes
  the engine received (the payloads), the pause (`finish_weight_update`'s in-place apply),
  and the engine process's peak resident memory above its level before the update;
- densely: `load_weights` of every tensor of the new version, through the worker;
  measured: the bytes handed over, the pause (the load), and the same peak.
Both end on the same bits (checked: the loader-format digests after each). Writes FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path


class PeakRSS:
    """The process's resident memory above `start`, sampled every millisecond."""

    def __init__(self):
        self.stop, self.peak, self.start = threading.Event(), 0, 0

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    def __enter__(self):
        self.start = self.peak = self.rss()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def extra(self) -> int:
        return self.peak - self.start


def loader_digests(worker) -> dict:
    from nemo_dcr.verify import state_digests

    return state_digests(worker.weight_transfer_engine.host._dcr_receiver.runtime.loader_state())


def finish_report(worker) -> dict:
    return dict(worker.weight_transfer_engine.last)


def make_dense_loader(tensors):
    """(collective_rpc) Every tensor through the model's `load_weights` (into the
    loader-format weights the CPU backend keeps), then vLLM's post-load processing of
    every layer, as a full reload does."""
    def load(worker) -> float:
        import torch

        runtime = worker.weight_transfer_engine.host._dcr_receiver.runtime
        t = time.perf_counter()
        with torch.no_grad():
            runtime._load(dict(tensors))
            runtime._reprocess(set(runtime._owner))
        return time.perf_counter() - t
    return load


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rates", default="0.01,0.03")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch
    from vllm import LLM

    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=64,
              max_num_seqs=1, max_num_batched_tokens=64, seed=0, weight_transfer_config={"backend": "dcr"})
    from safetensors.torch import load_file

    from nemo_dcr.checkpoint import safetensors_files
    from nemo_dcr.integrations.vllm.trainer import DCRTrainerEngine, DCRTrainerInitInfo, LLMClient

    weights = {}
    for path in safetensors_files(args.model):
        weights.update(load_file(path))
    dense_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    info = DCRTrainerInitInfo(rank=0, transport="local", transport_config={"dir": str(args.out.parent / "shm")},
                              timeout_s=300)
    sync = DCRTrainerEngine.trainer_init(info, client=LLMClient(llm), source=list(weights.items()))
    g = torch.Generator().manual_seed(0)
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        for round_ in range(args.rounds):
            for t in weights.values():  # ±1 ULP on `rate` of the elements
                bits = t.view(torch.int16).view(-1)
                pick = torch.rand(bits.numel(), generator=g) < rate
                step = torch.where(torch.rand(bits.numel(), generator=g) < 0.5, 1, -1).to(torch.int16)
                bits[pick] += step[pick]
            with PeakRSS() as mem:
                m = sync.send_weights()
            report = llm.collective_rpc(finish_report)[0]
            assert report["ok"], report
            after_dcr = llm.collective_rpc(loader_digests)[0]
            with PeakRSS() as dense_mem:
                copies = {n: t.clone() for n, t in weights.items()}  # what a dense transfer stages
                load_s = llm.collective_rpc(make_dense_loader(copies))[0]
                del copies
            assert llm.collective_rpc(loader_digests)[0] == after_dcr, "the dense load differs from the refit"
            rows.append({"rate": rate, "round": round_,
                         "dcr": {"bytes_received": int(m["wire_bytes"]), "pause_s": report["apply_s"],
                                 "reprocess_s": report.get("reprocess_s", 0.0), "stage_s": report["stage_s"],
                                 "peak_extra_bytes": mem.extra,
                                 "changed_elements": int(m["changed_elements"])},
                         "dense_load_weights": {"bytes_received": dense_bytes, "pause_s": load_s,
                                                "peak_extra_bytes": dense_mem.extra}})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    sync.shutdown()
    args.out.write_text(json.dumps({"dense_bytes": dense_bytes, "rows": rows}, indent=1))
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
