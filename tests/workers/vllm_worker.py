"""A vLLM `LLM` behind a JSON-lines command loop, run with the vLLM venv's python.

    python -m tests.workers.vllm_worker --model DIR [--ext QUALNAME] [--load-format dummy] [--tp 2]

Reads one JSON command per line on stdin and answers one JSON line on the stdout it
started with (everything vLLM prints goes to stderr): {"op": "rpc", "method", "args",
"kwargs"} -> `llm.collective_rpc` (list of per-worker results); {"op": "generate",
"prompt": [ids], "max_tokens"} -> greedy token ids; {"op": "exit"}.
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
    ap.add_argument("--ext", default="nemo_dcr.integrations.vllm.worker_extension.DCRWorkerExtension")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # vLLM's and the kernels' output -> stderr
    replies = os.fdopen(reply_fd, "w", buffering=1)

    def reply(obj) -> None:
        replies.write(json.dumps(obj) + "\n")

    t = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              max_model_len=64, max_num_seqs=1, max_num_batched_tokens=64, seed=0,
              worker_extension_cls=args.ext, load_format=args.load_format, tensor_parallel_size=args.tp,
              distributed_executor_backend="mp" if args.tp > 1 else None)
    reply({"ok": True, "result": {"startup_s": time.perf_counter() - t}})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "rpc":
                result = llm.collective_rpc(cmd["method"], args=tuple(cmd.get("args", ())),
                                            kwargs=cmd.get("kwargs") or {})
            elif cmd["op"] == "generate":
                params = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 16), detokenize=False,
                                        ignore_eos=True)
                out = llm.generate([{"prompt_token_ids": cmd["prompt"]}], params, use_tqdm=False)
                result = list(out[0].outputs[0].token_ids)
            elif cmd["op"] == "exit":
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
