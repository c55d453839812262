"""Megatron-core training on CPU (gloo, under torchrun): what the demo's trainer
(`nemo_dcr.demo.trainer`) trains with; the tests' Megatron workers use it too.

Typical worker::

    from nemo_dcr.demo import harness as H
    H.init_distributed(tp=2, pp=2)
    model, opt = H.build_trained_model(hf_config, tp=2, pp=2, lr=1e-3)
    for batch in H.make_batches(hf_config.vocab_size, seq_len=16, micro_batch=2,
                                num_micro=4, seed=H.dp_rank(), steps=2):
        H.train_step(model, opt, batch)
    H.shutdown()

Everything here is real megatron-core: local-spec GPTModel (bf16 params), megatron
DistributedDataParallel (fp32 main grads, grad reduce in fp32), the Megatron optimizer
(Adam; distributed optimizer by default), and ``get_forward_backward_func()``
(1F1B under PP, interleaved under virtual PP). `init_distributed` first installs the CPU
shim (`nemo_dcr.demo.megatron_cpu`; it does nothing where CUDA is available).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from nemo_dcr.demo import megatron_cpu
from nemo_dcr.runtimes.megatron.model import build_model_chunks, transformer_config_from_hf


def init_distributed(
    tp: int,
    pp: int,
    *,
    vpp: int | None = None,
    ep: int = 1,
    etp: int | None = None,
    seed: int = 1234,
    timeout_s: float = 300.0,
) -> None:
    """gloo process group from torchrun's env, megatron parallel state, and RNG seeds.

    Seeds: ``torch.manual_seed(seed)`` (CPU default generator: the data-parallel
    state, same on every rank) and ``model_parallel_cuda_manual_seed(seed)`` (the
    TP tracker states, via the shim on CPU). ``ep`` / ``etp``: expert-parallel and
    expert-tensor-parallel sizes for MoE models (the MoE config uses etp = 1).
    """
    megatron_cpu.install()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not dist.is_initialized():
        dist.init_process_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,  # None: = tp (megatron's default)
        )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def checkpoint_parts(checkpoint: str, family: str, qkv_residual: bool = False):
    """(HF config, tensor specs, converter, layout) of a trainer refitting from the version-0
    `checkpoint`: the family's converter (QKV as a residual on request) and the Megatron
    layout of this process's ranks (after `init_distributed`)."""
    from transformers import AutoConfig

    from nemo_dcr import registry
    from nemo_dcr.capture import megatron_layout
    from nemo_dcr.checkpoint import read_specs

    hf_config = AutoConfig.from_pretrained(checkpoint)
    options = {"qkv_as_residual": True} if qkv_residual else {}
    return hf_config, read_specs(checkpoint), registry.converter(family, hf_config, **options), megatron_layout()


def shutdown() -> None:
    """Tear down megatron parallel state and the process group."""
    from megatron.core import parallel_state

    if dist.is_initialized():
        dist.barrier()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def dp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def dp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size()


def build_trained_model(
    hf_config,
    tp: int,
    pp: int,
    lr: float,
    use_distributed_optimizer: bool = True,
    seed: int = 1234,
    *,
    vpp: int | None = None,
    ep: int = 1,
    clip_grad: float = 1.0,
    weight_decay: float = 0.0,
    sequence_parallel: bool = False,
):
    """(model chunks wrapped in megatron DDP, megatron optimizer) ready to train.

    Params are bf16, main grads fp32 (``grad_reduce_in_fp32``), Adam with fp32 main
    params (``OptimizerConfig(bf16=True)``). ``seed`` re-seeds the generators before
    the weights are initialised, so the same seed gives the same model for any TP/PP.
    ``sequence_parallel``: Megatron SP (needs tp > 1; MoE layers need it to train at tp > 1).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    assert parallel_state.get_tensor_model_parallel_world_size() == tp
    assert parallel_state.get_pipeline_model_parallel_world_size() == pp
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)

    overrides = {}
    if vpp is not None:
        overrides["virtual_pipeline_model_parallel_size"] = vpp
    config = transformer_config_from_hf(hf_config, tp=tp, pp=pp, ep=ep, sequence_parallel=sequence_parallel,
                                        **overrides)
    chunks = build_model_chunks(hf_config, config)

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        check_for_nan_in_grad=True,
    )
    model = [
        DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=chunk,
            # As Megatron-LM: only the first chunk is bucketed.
            disable_bucketing=i > 0,
        )
        for i, chunk in enumerate(chunks)
    ]
    for chunk in model:
        chunk.broadcast_params()  # identical starting weights across DP ranks

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=weight_decay,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=use_distributed_optimizer,
        clip_grad=clip_grad,
    )
    optimizer = get_megatron_optimizer(opt_config, model)

    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer


def make_batches(
    vocab: int,
    seq_len: int,
    micro_batch: int,
    num_micro: int,
    seed: int,
    steps: int | None = None,
):
    """Random token ids: ``num_micro`` tensors of shape [micro_batch, seq_len + 1].

    Seed by DP rank to give each DP replica its own data (realistic), and by the
    same value on all TP/PP ranks of a replica (required: they must see the same
    tokens). With ``steps``, returns a list of ``steps`` such batches.
    """
    gen = torch.Generator().manual_seed(int(seed))

    def one():
        return [
            torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=gen)
            for _ in range(num_micro)
        ]

    if steps is None:
        return one()
    return [one() for _ in range(steps)]


def _forward_step(data_iterator, model):
    sample = next(data_iterator)
    tokens = sample[:, :-1].contiguous()
    labels = sample[:, 1:].contiguous()
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=labels)

    def loss_func(per_token_loss):
        per_token_loss = per_token_loss.float()
        total = per_token_loss.sum()
        num_tokens = torch.tensor(per_token_loss.numel(), dtype=torch.int)
        # clone: the schedule divides `total` in place by num_tokens and num_microbatches.
        return total, num_tokens, {"lm loss": (total.detach().clone(), num_tokens.clone())}

    return output, loss_func


def train_step(model, optimizer, batch) -> tuple[bool, float | None]:
    """One optimizer step on ``batch`` (a list of micro-batches from make_batches).

    Real forward/backward with the LM cross-entropy through megatron's
    ``get_forward_backward_func()``, then ``optimizer.step()``. Returns
    (step succeeded, mean token loss on last-stage ranks else None).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()

    micro_batch, seq_plus_one = batch[0].shape
    if len(model) > 1:
        data_iterator = [iter(batch) for _ in model]
    else:
        data_iterator = iter(batch)
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=len(batch),
        seq_length=seq_plus_one - 1,
        micro_batch_size=micro_batch,
        forward_only=False,
    )
    success, _grad_norm, _zeros = optimizer.step()
    mean_loss = None
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and losses:
        total = sum(float(d["lm loss"][0]) for d in losses)
        count = sum(int(d["lm loss"][1]) for d in losses)
        mean_loss = total / max(count, 1)
    return bool(success), mean_loss
