"""NeMo RL's vLLM generation worker with NeMo-DCR, run with the vLLM venv's python.

    python -m tests.workers.nemo_rl_generation_worker --model DIR --generation-config JSON [--ext QUALNAME]

Starts `vllm.LLM` with the DCR worker extension, as NeMo RL's VllmGenerationWorker
does with its own, and answers JSON-line commands on the stdout it started with
(vLLM's output goes to stderr):

  {"op": "start", "receiver_id"}          start_dcr_receivers(llm, settings, model)
  {"op": "generate", "prompts", "max_tokens"}   greedy rollouts (token ids)
  {"op": "update", "expected_version"}    dcr_update_details(llm, ...) -> per-worker reports
  {"op": "rpc", "method", "args"}         llm.collective_rpc (digests, status, test hooks)
  {"op": "exit"}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--generation-config", required=True)
    ap.add_argument("--ext", default="nemo_dcr.runtimes.vllm.DCRWorkerExtension")
    args = ap.parse_args()
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    replies = os.fdopen(reply_fd, "w", buffering=1)

    def reply(obj) -> None:
        replies.write(json.dumps(obj) + "\n")

    t = time.perf_counter()
    from vllm import LLM, SamplingParams

    from nemo_dcr.integrations.nemo_rl import generation as G
    from nemo_dcr.integrations.nemo_rl.config import from_generation_config

    with open(args.generation_config) as f:
        settings = from_generation_config(json.load(f))
    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              max_model_len=64, max_num_seqs=4, max_num_batched_tokens=128, seed=0,
              worker_extension_cls=args.ext)
    reply({"ok": True, "result": {"startup_s": time.perf_counter() - t}})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "start":
                result = G.start_dcr_receivers(llm, settings, args.model, receiver_id=cmd["receiver_id"])
            elif cmd["op"] == "generate":
                params = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 16), detokenize=False,
                                        ignore_eos=True)
                outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], params, use_tqdm=False)
                result = [list(o.outputs[0].token_ids) for o in outs]
            elif cmd["op"] == "update":
                result = G.dcr_update_details(llm, cmd.get("expected_version"), settings=settings)
            elif cmd["op"] == "rpc":
                result = llm.collective_rpc(cmd["method"], args=tuple(cmd.get("args", ())))
            elif cmd["op"] == "exit":
                llm.collective_rpc("dcr_close")
                reply({"ok": True, "result": None})
                break
            else:
                raise ValueError(f"unknown command {cmd['op']!r}")
            reply({"ok": True, "result": result})
        except Exception as exc:  # reported to the test, which decides
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    replies.close()
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    sys.exit(main())
