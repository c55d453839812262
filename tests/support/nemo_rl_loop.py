"""A GRPO-shaped loop that drives NeMo-DCR exactly as NeMo RL drives its refit.

`refit_policy_generation` mirrors, line by line, the function of that name in NeMo RL
(`nemo_rl/algorithms/grpo.py`), with NeMo-DCR's two calls in place of the collective
ones:

    NeMo RL                                         here
    policy.broadcast_weights_for_collective()       policy.stream_weights_via_dcr()
    policy_generation.update_weights_from_collective()   policy_generation.update_weights_via_dcr()
    ray.get(futures)                                ray_get(futures)  (concurrent.futures)

`grpo_train` mirrors the order of NeMo RL's GRPO step: refit when the generation is
stale, else prepare_for_generation; generate; finish_generation; prepare_for_training;
train; mark the generation stale.

The handles stand where NeMo RL's `Policy` (a Ray worker group of Megatron policy
workers) and `VllmGeneration` stand: `PolicyHandle` talks to the Megatron ranks running
under torchrun (`tests/workers/nemo_rl_policy_worker.py`, rank 0 relays every command
to all ranks, as Ray calls every worker), `GenerationHandle` to a vLLM engine in the
vLLM venv (`tests/workers/nemo_rl_generation_worker.py`). Each call returns futures,
as Ray's remote calls do.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path


def ray_get(futures):
    """`ray.get` for concurrent.futures: a list of results, or one result."""
    if isinstance(futures, (list, tuple)):
        return [f.result() for f in futures]
    return futures.result()


def refit_policy_generation(policy, policy_generation, colocated_inference: bool) -> None:
    """NeMo RL's `refit_policy_generation`, NeMo-DCR calls in place of the collective ones."""
    if colocated_inference:
        policy.offload_before_refit()
        policy_generation.prepare_for_generation(tags=["weights"])

    # update weights
    update_success = False
    # update weights through NeMo-DCR (NeMo RL: through nccl)
    futures_train = policy.stream_weights_via_dcr()
    futures_inference = policy_generation.update_weights_via_dcr()
    # wait for all futures to complete
    ray_get(futures_train)
    results = ray_get(futures_inference)
    update_success = all(result for result in results if result is not None)

    # check if update is successful
    if not update_success:
        error_tag = "nemo-dcr"
        error_message = (
            "❌ Error: Updating weights for the generation policy failed during refit.\n"
            f"This often indicates an issue with {error_tag} or "
            "a problem within the generation backend (e.g., vLLM worker).\n"
        )
        raise RuntimeError(error_message)

    if colocated_inference:
        policy.offload_after_refit()
        policy_generation.prepare_for_generation(tags=["kv_cache"])


@dataclass
class LoopState:
    need_refit: bool = True
    policy_generation_stale: bool = False  # the engines start from the trainer's weights
    step: int = 0
    rollouts: list = field(default_factory=list)


def grpo_train(policy, policy_generation, prompts, steps: int, state: LoopState, *, colocated_inference=False,
               on_refit=None, max_tokens: int = 16) -> LoopState:
    """`steps` GRPO steps in NeMo RL's order; `on_refit(state)` runs after each refit."""
    for _ in range(steps):
        # prepare for generation
        if state.need_refit and state.policy_generation_stale:
            refit_policy_generation(policy, policy_generation, colocated_inference)
            state.policy_generation_stale = False
            if on_refit is not None:
                on_refit(state)
        else:
            policy_generation.prepare_for_generation()
        # generate
        rollouts = ray_get(policy_generation.generate(prompts, max_tokens))
        state.rollouts.append(rollouts)
        policy_generation.finish_generation()
        # train on the rollouts (prompt + completion; GRPO's advantages are not the point here)
        policy.prepare_for_training()
        ray_get(policy.train([p + r for p, r in zip(prompts, rollouts)]))
        state.policy_generation_stale = True
        state.step += 1
    return state


class PolicyHandle:
    """NeMo RL's `Policy` for the test: the Megatron ranks under torchrun."""

    def __init__(self, proc: subprocess.Popen, control: str, log: Path, timeout_s: float = 240.0):
        import zmq

        self.proc, self.log, self.timeout_s = proc, log, timeout_s
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(control)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="policy")
        self.last_stream: dict | None = None
        self.calls: list[str] = []

    def call(self, **cmd) -> dict:
        self.sock.send(json.dumps(cmd).encode())
        deadline = time.monotonic() + self.timeout_s
        while not self.sock.poll(200):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text()[-6000:] if self.log.exists() else ""
                raise AssertionError(f"policy workers gave no reply to {cmd['op']} (rc={self.proc.poll()}):\n{tail}")
        return json.loads(self.sock.recv())

    def _submit(self, fn, *args) -> Future:
        return self.pool.submit(fn, *args)

    # -- what NeMo RL's GRPO loop calls --------------------------------------------------
    def stream_weights_via_dcr(self) -> list[Future]:
        def run():
            self.last_stream = self.call(op="stream")
            return self.last_stream["ok"]
        return [self._submit(run)]

    def train(self, tokens) -> list[Future]:
        return [self._submit(lambda: self.call(op="train", tokens=tokens))]

    def prepare_for_training(self) -> None:
        self.calls.append("prepare_for_training")

    def offload_before_refit(self) -> None:
        self.calls.append("offload_before_refit")

    def offload_after_refit(self) -> None:
        self.calls.append("offload_after_refit")

    # -- test only -----------------------------------------------------------------------
    def export_digests(self) -> dict:
        return self.call(op="export")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001
                pass
        self.sock.close()
        self.pool.shutdown(wait=False)


class GenerationHandle:
    """NeMo RL's `VllmGeneration` for the test: one vLLM engine in the vLLM venv."""

    def __init__(self, proc: subprocess.Popen, log: Path):
        self.proc, self.log = proc, log
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="generation")
        self.last_update: list[dict] | None = None
        self.calls: list[str] = []

    def read(self, what: str):
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text()[-6000:] if self.log.exists() else ""
            raise AssertionError(f"vLLM generation worker exited before its {what} (rc={self.proc.poll()}):\n{tail}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise AssertionError(f"vLLM generation worker: {reply['error']}")
        return reply["result"]

    def call(self, **cmd):
        with self.lock:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
            return self.read(cmd.get("method", cmd["op"]))

    def rpc(self, method: str, *args):
        (result,) = self.call(op="rpc", method=method, args=list(args))  # one vLLM worker (TP=1)
        return result

    # -- what NeMo RL's GRPO loop calls --------------------------------------------------
    def update_weights_via_dcr(self) -> list[Future]:
        def run():
            self.last_update = self.call(op="update")
            return all(r["ok"] for r in self.last_update)
        return [self.pool.submit(run)]

    def generate(self, prompts, max_tokens: int = 16) -> Future:
        return self.pool.submit(lambda: self.call(op="generate", prompts=prompts, max_tokens=max_tokens))

    def prepare_for_generation(self, tags=None) -> None:
        self.calls.append(f"prepare_for_generation({tags})")

    def finish_generation(self) -> None:
        self.calls.append("finish_generation")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait()
        self.pool.shutdown(wait=False)
