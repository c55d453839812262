"""What each trainer rank owns after ``optimizer.step()``, and when to read it.

Ownership is exclusive: across the data-parallel ranks of one TP/PP(/EP) position,
the owned ranges of every parameter partition its flat local shard exactly, so
every element of the model is read by exactly one rank and nothing is gathered.

* Megatron's ``DistributedOptimizer`` already defines ownership: each DP rank
  updates one contiguous slice of every grad/param buffer bucket, and the slice
  of each parameter it covers is ``gbuf_ranges[b][(param_dtype, grad_dtype)][bucket]
  ["param_map"][param]["param"]`` (a ``Range`` with ``.start`` / ``.end`` in the
  param's flattened local shard). We use exactly that.
* Optimizers that do not shard (Megatron's ``Float16OptimizerWithFloat16Params`` /
  ``FP32Optimizer``, plain ``torch.optim``): every DP rank holds the whole param,
  so ownership is *defined* as an even split of each param's flat range into
  ``dp_size`` contiguous chunks (:func:`even_split`); rank r owns chunk r.

megatron-core attributes relied on (checked on 0.16.1; they are public attributes
and present in later releases): ``ChainedOptimizer.chained_optimizers``,
``DistributedOptimizer.gbuf_ranges`` (and its nested "param_map"/"param" keys,
``Range.start`` / ``Range.end``), ``DistributedOptimizer.distributed_optimizer_instance_id``
(only instance 0 owns when several optimizer instances replicate the state), and the
``param.allreduce`` flag megatron sets to False on expert parameters (their DP group
is the expert-data-parallel group). Megatron-FSDP is not supported.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from nemo_dcr.errors import Unsupported
from nemo_dcr.layout import LocalParam, OwnedRange

__all__ = [
    "even_split",
    "megatron_owned_ranges",
    "megatron_layout",
    "torch_owned_ranges",
    "attach_post_step_hook",
    "PostStepHookHandle",
    "owned_numel",
]


def even_split(numel: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of chunk ``rank`` when ``numel`` elements are split into ``size``
    contiguous chunks whose lengths differ by at most one."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid rank {rank} of size {size}")
    return (numel * rank) // size, (numel * (rank + 1)) // size


def _owned(name: str, param: torch.Tensor, start: int, stop: int) -> OwnedRange:
    local = LocalParam(name=name, local_shape=tuple(param.shape), dtype=param.dtype)
    if not 0 <= start <= stop <= local.numel:
        raise ValueError(f"range [{start}:{stop}] outside {name} of {local.numel} elements")
    # A live view of the param's storage: read it after each step, never a copy.
    flat = param.detach().view(-1)
    return OwnedRange(param=local, start=start, stop=stop, tensor=flat[start:stop])


def _strip_module(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def torch_owned_ranges(
    model: torch.nn.Module, dp_rank: int = 0, dp_size: int = 1
) -> list[OwnedRange]:
    """Owned ranges for a plain torch module (single process or torch DDP).

    Every parameter (frozen ones included: they simply never change) is split evenly
    into ``dp_size`` contiguous chunks and rank ``dp_rank`` owns chunk ``dp_rank``;
    empty chunks (params smaller than ``dp_size``) are omitted. Names come from
    ``named_parameters()`` with leading "module." prefixes stripped.
    """
    out = []
    for raw, param in model.named_parameters():
        start, stop = even_split(param.numel(), dp_rank, dp_size)
        if stop > start:
            out.append(_owned(_strip_module(raw), param, start, stop))
    return out


def _leaf_optimizers(optimizer) -> list:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return [optimizer]
    leaves = []
    for sub in chained:
        leaves.extend(_leaf_optimizers(sub))
    return leaves


def _is_distributed(optimizer) -> bool:
    return hasattr(optimizer, "gbuf_ranges")


def _dp_coords(param) -> tuple[int, int]:
    """(rank, size) of the group a non-sharding optimizer replicates ``param`` over."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "allreduce", True):  # expert parameter
        return ps.get_expert_data_parallel_rank(), ps.get_expert_data_parallel_world_size()
    return (
        ps.get_data_parallel_rank(with_context_parallel=True),
        ps.get_data_parallel_world_size(with_context_parallel=True),
    )


def megatron_owned_ranges(optimizer, model_chunks) -> list[OwnedRange]:
    """This rank's owned slices of every trainable param of ``model_chunks``.

    ``optimizer`` is what ``get_megatron_optimizer`` returned (a ``ChainedOptimizer``
    or a single Megatron optimizer). Names are normalized as in
    :func:`nemo_dcr.runtimes.megatron.model.megatron_param_name_map`. Ranges are
    sorted by (name, start). Call it once after the optimizer is built: the views
    stay valid as long as megatron does not reallocate its param buffers.
    """
    from nemo_dcr.runtimes.megatron.model import megatron_param_name_map

    names = {id(p): n for n, p in megatron_param_name_map(model_chunks).items()}
    out: list[OwnedRange] = []
    covered: set[int] = set()
    replicated = False
    for leaf in _leaf_optimizers(optimizer):
        if getattr(leaf, "is_stub_optimizer", False):
            continue
        if not _is_distributed(leaf):
            replicated = True
            continue
        if getattr(leaf, "ddp_config", None) is not None and getattr(
            leaf.ddp_config, "use_megatron_fsdp", False
        ):
            raise Unsupported("Megatron-FSDP ownership is not supported")
        # With num_distributed_optimizer_instances > 1 every instance holds the same
        # shards; the first one is the owner so ownership stays exclusive.
        owner = getattr(leaf, "distributed_optimizer_instance_id", 0) == 0
        for per_buffer in leaf.gbuf_ranges:
            for per_bucket in per_buffer.values():
                for bucket in per_bucket:
                    for param, ranges in bucket["param_map"].items():
                        covered.add(id(param))
                        if id(param) not in names:
                            raise KeyError("optimizer param not found in model_chunks")
                        r = ranges["param"]
                        if owner and r.end > r.start:
                            out.append(_owned(names[id(param)], param, r.start, r.end))
    if replicated:
        for name, param in megatron_param_name_map(model_chunks).items():
            if id(param) in covered or not param.requires_grad:
                continue
            rank, size = _dp_coords(param)
            start, stop = even_split(param.numel(), rank, size)
            if stop > start:
                out.append(_owned(name, param, start, stop))
    out.sort(key=lambda r: (r.param.name, r.start))
    return out


class PostStepHookHandle:
    """Returned by :func:`attach_post_step_hook`; ``remove()`` detaches the callback."""

    def __init__(self, remove: Callable[[], None]):
        self._remove = remove
        self._removed = False

    def remove(self) -> None:
        if not self._removed:
            self._removed = True
            self._remove()


_HOOKS_ATTR = "_nemo_dcr_post_step_hooks"


def attach_post_step_hook(optimizer, callback: Callable[[], None]) -> PostStepHookHandle:
    """Call ``callback()`` after every successful ``optimizer.step()``.

    torch optimizers: ``register_step_post_hook``. Megatron optimizers (whose step
    returns ``(update_successful, grad_norm, num_zeros_in_grad)``): the instance's
    ``step`` is wrapped once and the callback runs only when the update succeeded
    (skipped steps, e.g. on inf/nan grads, leave the params unchanged). Several hooks
    may be attached; they run in attachment order.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        handle = optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: callback())
        return PostStepHookHandle(handle.remove)

    state = optimizer.__dict__.get(_HOOKS_ATTR)
    if state is None:
        # One wrapper per optimizer instance, shared by all attached callbacks.
        hooks: dict[object, Callable[[], None]] = {}
        had_own_step = "step" in optimizer.__dict__
        original = optimizer.step

        def step(*args, **kwargs):
            result = original(*args, **kwargs)
            success = result[0] if isinstance(result, tuple) else result
            if success:
                for hook in list(hooks.values()):
                    hook()
            return result

        def unwrap():
            if had_own_step:
                optimizer.step = original
            else:
                del optimizer.step
            del optimizer.__dict__[_HOOKS_ATTR]

        optimizer.step = step
        state = optimizer.__dict__[_HOOKS_ATTR] = (hooks, unwrap)

    hooks, unwrap = state
    key = object()
    hooks[key] = callback

    def remove():
        hooks.pop(key, None)
        if not hooks and optimizer.__dict__.get(_HOOKS_ATTR) is state:
            unwrap()

    return PostStepHookHandle(remove)


def megatron_layout():
    """This training rank's coordinates from `megatron.core.parallel_state`."""
    from megatron.core import parallel_state as ps

    from nemo_dcr.layout import ParallelLayout

    return ParallelLayout(tp_size=ps.get_tensor_model_parallel_world_size(),
                          tp_rank=ps.get_tensor_model_parallel_rank(),
                          pp_size=ps.get_pipeline_model_parallel_world_size(),
                          pp_rank=ps.get_pipeline_model_parallel_rank(),
                          dp_size=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
                          ep_size=ps.get_expert_model_parallel_world_size(),
                          ep_rank=ps.get_expert_model_parallel_rank(),
                          etp_size=ps.get_expert_tensor_parallel_world_size(),
                          etp_rank=ps.get_expert_tensor_parallel_rank())


def owned_numel(ranges: Iterable[OwnedRange]) -> int:
    """Total elements in ``ranges`` (for logging and tests)."""
    return sum(len(r) for r in ranges)
