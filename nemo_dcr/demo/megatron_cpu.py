"""What lets megatron-core (0.16.1) run on a CPU-only torch build (gloo).

Megatron-core hard-codes CUDA in a handful of places that a CPU build of torch
rejects (``torch.cuda.current_device()`` raises "Torch not compiled with CUDA
enabled"). Call :func:`install` once, *before* building models / optimizers /
initialising megatron's parallel state, in every process. It is idempotent and
does nothing at all when CUDA is available. `nemo-dcr demo` (`nemo_dcr.demo.harness`)
and the tests install it; it patches torch process-wide, so the library proper never
imports it.

What it patches, and why (each item is needed by TP, PP 1F1B, DP with the
distributed optimizer in bf16, checked with megatron-core 0.16.1):

1. ``torch.cuda.current_device`` -> ``torch.device("cpu")``: megatron allocates
   buffers with ``device=torch.cuda.current_device()`` (TP mappings, p2p shape
   exchange, DDP param/grad buffers, optimizer shards).
2. ``torch.cuda.synchronize`` / ``empty_cache`` -> no-ops; ``torch.cuda.Stream``,
   ``Event``, ``stream()``, ``current_stream()``, ``default_stream()`` -> inert
   CPU stand-ins (DDP and p2p code create / wait on streams; CPU work is
   synchronous so waiting is trivially satisfied).
3. A ``TorchFunctionMode`` kept entered for the life of the process that maps
   CUDA devices to CPU: ``device="cuda"`` / ``"cuda:N"`` / ``torch.device("cuda")``
   keyword arguments (``torch.zeros(..., device="cuda")`` in clip_grads,
   schedules, the optimizer), ``Tensor.cuda()`` (returns the tensor),
   ``Tensor.to("cuda")``; and ``Tensor.type()`` (no arguments) reports
   ``torch.cuda.<T>Tensor`` so megatron's ``param.type() == 'torch.cuda.BFloat16Tensor'``
   dtype checks in the (distributed) optimizer classify params correctly.
4. The model-parallel RNG tracker (``megatron.core.tensor_parallel.random``):
   its "CUDA" generator state is the CPU default generator (``torch.get/set_rng_state``),
   and ``CudaRNGStatesTracker.add`` seeds through the CPU generator, so
   ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` work.
   On CPU, the default ("data-parallel") generator and the CUDA one are the same
   generator; callers seed it with ``torch.manual_seed`` themselves. The
   "CPU RNG state changed within GPU RNG context" warning is expected then and
   is filtered out.
5. MoE without Transformer Engine: ``megatron.core.transformer.moe.moe_utils`` leaves
   ``te_general_gemm`` undefined when TE is missing (its ``except ImportError`` branch
   sets the other TE names only), so the router's gating linear raises NameError. The
   shim defines it as None, which selects the plain ``torch.mm`` path.

Collectives: torch 2.13's gloo supports every collective megatron uses here
(``reduce_scatter_tensor``, ``all_gather_into_tensor``, bf16 all-reduce, AVG),
so nothing is rerouted. Megatron's fusions (bias-dropout, rope, softmax,
gradient-accumulation, cross-entropy) must stay off in the TransformerConfig;
they need CUDA kernels or ``torch.compile``.
"""

from __future__ import annotations

import logging

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_MODE: "_CudaToCpuMode | None" = None
_CPU = torch.device("cpu")


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    # A bare int is a CUDA ordinal for torch factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU for every torch call in the process."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            kwargs = dict(kwargs, device=_CPU)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _Stream:
    """Inert stand-in for torch.cuda.Stream / Event (CPU work is synchronous)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _Stream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, *args, **kwargs):
        pass

    def elapsed_time(self, *args, **kwargs):
        return 0.0


class _NullContext:
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _DropTrackerWarning(logging.Filter):
    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: _CPU
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _Stream
    cuda.Event = _Stream
    cuda.stream = _NullContext
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def _get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def _add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    mrandom._get_cuda_rng_state = _get_state
    mrandom._set_cuda_rng_state = _set_state
    mrandom.CudaRNGStatesTracker.add = _add
    logging.getLogger(mrandom.__name__).addFilter(_DropTrackerWarning())


def _patch_moe_utils() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def install() -> bool:
    """Install the CPU redirections once per process. Returns True if active."""
    global _INSTALLED, _MODE
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    _patch_torch_cuda()
    _patch_rng_tracker()
    _patch_moe_utils()
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()  # stays entered for the life of the process
    _INSTALLED = True
    return True


def installed() -> bool:
    return _INSTALLED
