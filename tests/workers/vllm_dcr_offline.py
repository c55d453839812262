"""A plain PyTorch training loop refitting an offline vLLM `LLM` through vLLM's own
weight-transfer API with `weight_transfer_config={"backend": "dcr"}` (run with the vLLM
venv's python).

    python -m tests.workers.vllm_dcr_offline --model DIR --out DIR [--steps 3]

The trainer is a Hugging Face model (FP32 master weights, AdamW) with the served
checkpoint's names, sent as BF16 (`ServedDtypeSource`);
`DCRTrainerEngine` sends its changes each step. After each step the trainer's weights
are saved to `<out>/step<k>` and the engine's loader-format digests and greedy tokens go
to `<out>/step<k>.json`, for the test to compare with a fresh vLLM load. Then three
faulty updates, each of which must leave the engine serving what it served: a corrupted
payload, a forged one (signed with another key), and one cut off in transit. A last
step must recover. Prints one JSON line (the per-step metrics) on success.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

PROMPTS = [[3, 17, 42, 99, 7, 250, 11, 64], [300, 5, 5, 123, 77, 19, 201, 8]]


def engine_digests(worker) -> dict:
    """(collective_rpc) The served model's parameters in loader format."""
    from nemo_dcr.verify import state_digests

    return state_digests(worker.weight_transfer_engine.host._dcr_receiver.runtime.loader_state())


def engine_report(worker) -> dict:
    """(collective_rpc) The engine's last finish_weight_update report."""
    return dict(worker.weight_transfer_engine.last)


def train_step(model, optimizer, seed: int) -> None:
    """One AdamW step of the Hugging Face model on random tokens (seeded)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (4, 16), generator=g)
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def save_served(model, model_dir: str, out: Path) -> None:
    """The trainer's weights as the engine serves them (BF16), as a checkpoint in `out`
    for a fresh vLLM load."""
    import shutil

    from safetensors.torch import save_file

    from nemo_dcr.integrations.vllm.trainer import ServedDtypeSource

    out.mkdir(parents=True)
    save_file(dict(ServedDtypeSource(model)), str(out / "model.safetensors"))
    shutil.copy(Path(model_dir) / "config.json", out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    # vLLM first: its CPU start-up scans loaded modules, which trips over numba's LLVM
    # binding once NeMo-DCR's compiled kernels are loaded (see nemo_dcr/wire/versions.py).
    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=64,
              max_num_seqs=2, max_num_batched_tokens=128, seed=0, weight_transfer_config={"backend": "dcr"})
    from nemo_dcr.errors import TransferFailed
    from nemo_dcr.integrations.vllm.trainer import DCRTrainerEngine, DCRTrainerInitInfo, LLMClient, ServedDtypeSource
    from tests.support.faults import FaultyEnd

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-6, weight_decay=0.0)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, detokenize=False, ignore_eos=True)

    def served() -> dict:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        return {"digests": llm.collective_rpc(engine_digests)[0], "tokens": [list(o.outputs[0].token_ids)
                                                                           for o in outs]}

    info = DCRTrainerInitInfo(rank=0, transport="local", key_env="DCR_HMAC_KEY", timeout_s=20,
                              transport_config={"dir": str(args.out / "shm"), "timeout_s": 10})
    sync = DCRTrainerEngine.trainer_init(info, client=LLMClient(llm), source=ServedDtypeSource(model))
    producer = sync.refit.refit.producer

    def save(step: int) -> None:
        save_served(model, args.model, args.out / f"step{step}")
        (args.out / f"step{step}.json").write_text(json.dumps(served()))

    steps = []
    for step in range(1, args.steps + 1):
        train_step(model, optimizer, step)
        t = time.perf_counter()
        m = sync.send_weights()
        report = llm.collective_rpc(engine_report)[0]
        assert report["ok"], report
        steps.append({"step": step, "seconds": time.perf_counter() - t, "version": m["version"],
                      "changed_elements": m["changed_elements"], "wire_bytes": m["wire_bytes"],
                      "dense_bytes": m["dense_bytes"], "pause_s": report["apply_s"],
                      "weight_version": llm.get_weight_version()})
        save(step)

    faults = {}
    for kind in ("corrupt", "forge", "drop"):
        before = served()
        train_step(model, optimizer, 100 + len(faults))
        if kind == "forge":
            real_key, producer.key = producer.key, b"not-the-shared-key"
        else:
            producer.end = FaultyEnd(producer.end, {f"{producer.id}-000000": kind})
        try:
            sync.send_weights()
        except TransferFailed as e:
            faults[kind] = str(e)[:300]
        else:
            raise AssertionError(f"a {kind} update committed")
        finally:
            if kind == "forge":
                producer.key = real_key
            else:
                producer.end = producer.end.inner
        assert served() == before, f"the engine changed on a {kind} update"
        assert not llm.collective_rpc(engine_report)[0]["ok"]
    step = args.steps + 1
    m = sync.send_weights()  # recovers: everything since the last commit
    steps.append({"step": step, "version": m["version"], "failed_transfers_before": m["failed_transfers_before"],
                  "wire_bytes": m["wire_bytes"]})
    save(step)
    sync.shutdown()
    print(json.dumps({"steps": steps, "faults": faults}), flush=True)
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    sys.exit(main())
