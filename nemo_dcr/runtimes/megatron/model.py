"""Build a megatron-core ``GPTModel`` that matches a Hugging Face Llama / Qwen2 / Qwen3 /
Qwen3-MoE / Mixtral config.

The model uses megatron-core's *local* (non-Transformer-Engine) layer spec
(``get_gpt_layer_local_spec``), so it runs wherever torch runs:

=====================  ==========================================================
HF config              Megatron TransformerConfig / GPTModel
=====================  ==========================================================
hidden_size            hidden_size
num_hidden_layers      num_layers
num_attention_heads    num_attention_heads
num_key_value_heads    num_query_groups (GQA)
head_dim               kv_channels
intermediate_size      ffn_hidden_size; gated_linear_unit=True, activation=silu
rms_norm_eps           layernorm_epsilon, normalization="RMSNorm"
model_type == qwen3    qk_layernorm=True (q_norm / k_norm over head_dim)
attention_bias         add_qkv_bias (Qwen2-style q/k/v bias); no other biases
model_type == qwen2    add_qkv_bias=True (Qwen2 always biases q/k/v, not o_proj)
rope_theta             rotary_base; rope, non-interleaved (HF ``rotate_half``)
tie_word_embeddings    share_embeddings_and_output_weights
vocab_size             padded_vocab_size(vocab, tp, make_vocab_size_divisible_by)
initializer_range      init_method_std
num_experts (MoE)      num_moe_experts; SequentialMLP experts (local spec, no grouped GEMM)
num_experts_per_tok    moe_router_topk
moe_intermediate_size  moe_ffn_hidden_size
norm_topk_prob         True: softmax over the top-k logits (Megatron default);
                       False: moe_router_pre_softmax (softmax over all, then top-k)
num_local_experts      num_moe_experts (Mixtral)
intermediate_size      moe_ffn_hidden_size (Mixtral: every MLP is sparse)
(Mixtral router)       softmax over all, top-k renormalised = softmax over the top-k
                       logits (Megatron default); router_jitter_noise must be 0
sliding_window         Mixtral: refused unless None (Qwen: use_sliding_window refused)
=====================  ==========================================================

MoE (Qwen3-MoE, ``model_type == "qwen3_moe"``): every layer sparse (``decoder_sparse_step
== 1``, no ``mlp_only_layers``), no shared experts, no router bias, router in fp32
(``moe_router_dtype="fp32"``: HF takes the softmax in fp32), load-balancing loss off
(``moe_router_load_balancing_type="none"``; pass an override to train with one), the
"allgather" token dispatcher, and expert-TP = 1 by default (each expert whole on one
rank; ``expert_model_parallel_size`` comes from ``parallel_state`` or an override).
Mixtral (``model_type == "mixtral"``) is built the same way: every layer sparse, no QK-norm.

Norms: :class:`LocalRMSNorm` (torch RMSNorm) replaces the local spec's ``WrappedTorchNorm``
in every layer and as the final norm, so sequence parallelism works without Transformer
Engine: the weights of norms that see sequence-split activations are marked
``sequence_parallel`` and Megatron's ``finalize_model_grads`` sums their grads over TP.

Parameter names: :func:`megatron_param_name_map` gives every parameter of a
rank's model chunks under its *normalized* name: wrapper prefixes ("module.")
stripped and the chunk-local ``decoder.layers.<i>.`` index replaced by the
global layer index, so names are stable under PP and virtual PP.

Only megatron-core is imported here; nothing in this module patches torch.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from nemo_dcr.errors import Unsupported

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")

__all__ = [
    "padded_vocab_size",
    "LocalRMSNorm",
    "rope_theta_of",
    "transformer_config_from_hf",
    "build_gpt_model",
    "build_model_chunks",
    "megatron_param_name_map",
    "unwrap_model",
]


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Vocabulary size Megatron allocates for ``vocab`` real tokens.

    Rounds up to a multiple of ``divisible_by * tp``: the same rule as Megatron-LM's
    ``megatron.training.tokenizer.tokenizer._vocab_size_with_padding`` and
    Megatron-Bridge's ``megatron.bridge.utils.vocab_utils.calculate_padded_vocab_size``
    (``make_vocab_size_divisible_by`` times the tensor-parallel size). Rows at index
    >= ``vocab`` of the embedding / output layer are padding and are not part of the
    HF checkpoint.
    """
    if vocab < 1 or tp < 1 or divisible_by < 1:
        raise ValueError(f"invalid vocab/tp/divisible_by: {vocab}/{tp}/{divisible_by}")
    multiple = divisible_by * tp
    return ((vocab + multiple - 1) // multiple) * multiple


def rope_theta_of(hf_config) -> float:
    """RoPE base across transformers versions (``rope_parameters`` in 5.x)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(hf_config, "rope_theta", None)
    return float(theta) if theta is not None else 10000.0


def _rope_type_of(hf_config) -> str:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if not params:
        return "default"
    return params.get("rope_type", params.get("type", "default"))


def _head_dim_of(hf_config) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is None:
        head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    return int(head_dim)


def transformer_config_from_hf(
    hf_config,
    *,
    tp: int,
    pp: int,
    ep: int = 1,
    params_dtype: torch.dtype = torch.bfloat16,
    sequence_parallel: bool = False,
    **overrides: Any,
):
    """A ``TransformerConfig`` for ``hf_config`` (Llama / Qwen2 / Qwen3 / Qwen3-MoE) at TP ``tp``
    × PP ``pp`` (× EP ``ep`` for MoE).

    Dropout is taken from the HF config (attention_dropout; no hidden dropout in
    Llama / Qwen3). All CUDA-only fusions are off so the config also runs on CPU;
    pass ``overrides`` (any TransformerConfig field) to turn them on for GPU runs,
    or to set e.g. ``virtual_pipeline_model_parallel_size``.

    ``sequence_parallel=True`` works with :func:`build_gpt_model`'s norms (see
    :class:`LocalRMSNorm`); MoE layers with TP > 1 need it to train.
    """
    from megatron.core.transformer import TransformerConfig

    model_type = getattr(hf_config, "model_type", "")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise Unsupported(f"hidden_act {act!r}: only SwiGLU (silu) is supported")
    if _rope_type_of(hf_config) != "default":
        raise Unsupported(f"rope type {_rope_type_of(hf_config)!r} is not supported")
    # Qwen2's config has no attention_bias flag: its q/k/v projections always carry one.
    attention_bias = bool(getattr(hf_config, "attention_bias", False)) or model_type == "qwen2"
    if attention_bias and model_type == "llama":
        # Llama's attention_bias also biases o_proj, which Megatron only has together
        # with MLP biases (add_bias_linear).
        raise Unsupported("Llama attention_bias (o_proj bias) is not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise Unsupported("sliding-window attention is not supported")
    if getattr(hf_config, "mlp_bias", False):
        raise Unsupported("mlp_bias is not supported")
    moe = _moe_fields(hf_config)
    if ep != 1:
        if not moe:
            raise Unsupported(f"expert parallelism (ep={ep}) needs an MoE model")
        moe["expert_model_parallel_size"] = ep

    fields = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None)
        or hf_config.num_attention_heads,
        kv_channels=_head_dim_of(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=attention_bias,
        qk_layernorm=model_type.startswith("qwen3"),
        rotary_interleaved=False,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Initialise full weights on CPU, then split: the same values for any TP size.
        use_cpu_initialization=True,
        # CUDA-kernel / torch.compile fusions: off (CPU-safe defaults).
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        attention_softmax_in_fp32=True,
        # megatron-core's own default ("full") warns that it is deprecated in every rank;
        # [] is what it turns "full" into (no CUDA graphs are captured either way).
        cuda_graph_scope=[],
    )
    fields.update(moe)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _moe_fields(hf_config) -> dict:
    """TransformerConfig MoE fields for a Qwen3-MoE or Mixtral config ({} for dense models)."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if not experts:
        return {}
    model_type = getattr(hf_config, "model_type", "")
    if model_type == "qwen3_moe":
        if getattr(hf_config, "decoder_sparse_step", 1) != 1 or getattr(hf_config, "mlp_only_layers", None):
            raise Unsupported("dense layers between MoE layers (decoder_sparse_step / mlp_only_layers) "
                              "are not supported")
        if getattr(hf_config, "shared_expert_intermediate_size", 0):
            raise Unsupported("shared experts are not supported")
        expert_ffn = hf_config.moe_intermediate_size
        pre_softmax = not bool(getattr(hf_config, "norm_topk_prob", True))
    elif model_type == "mixtral":
        # HF's jitter multiplies the experts' inputs too (in training); Megatron's
        # moe_input_jitter_eps only jitters the router's input: not the same model.
        if float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0) != 0.0:
            raise Unsupported(f"Mixtral router_jitter_noise={hf_config.router_jitter_noise}: only 0 is supported")
        if getattr(hf_config, "sliding_window", None) is not None:  # Mixtral has no on/off flag: a size means on
            raise Unsupported(f"Mixtral sliding_window={hf_config.sliding_window}: sliding-window attention "
                              "is not supported")
        expert_ffn = hf_config.intermediate_size
        # HF: softmax over all experts, top-k, renormalised over the k = a softmax over
        # the top-k logits, Megatron's default.
        pre_softmax = False
    else:
        raise Unsupported(f"MoE model_type {model_type!r}: only qwen3_moe and mixtral are supported")
    return {
        "num_moe_experts": int(experts),
        "moe_router_topk": int(hf_config.num_experts_per_tok),
        "moe_ffn_hidden_size": int(expert_ffn),
        "moe_router_pre_softmax": pre_softmax,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": "fp32",
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "expert_tensor_parallel_size": 1,
    }


class LocalRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built like the local spec's ``WrappedTorchNorm`` (same
    parameters and numerics), but also correct under sequence parallelism.

    With SP each TP rank normalises only its slice of the sequence, so the weight's grad
    is a partial sum; megatron-core's ``finalize_model_grads`` sums over TP the grads of
    parameters whose ``sequence_parallel`` attribute is true (what TE / Apex norms set).
    ``sequence_split=False`` is for q/k norms: they act on TP-split heads of the whole
    sequence, and ``finalize_model_grads`` already sums them (by name, under
    ``qk_layernorm``), so they must not be marked.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, sequence_split: bool = True, **_unused):
        if config.normalization != "RMSNorm":
            raise Unsupported(f"normalization {config.normalization!r}: the local-spec norm is RMSNorm only")
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                raise Unsupported(f"{flag}=True is not supported by the local (torch) norm")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel and sequence_split)


def _local_spec(config, vp_stage: int | None):
    """The local GPT layer spec with :class:`LocalRMSNorm` for every norm, as block
    submodules (so the final norm is ours too)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm, normalization=config.normalization,
    )
    sub = layer.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = LocalRMSNorm
    if config.qk_layernorm:
        attn = sub.self_attention.submodules
        attn.q_layernorm = attn.k_layernorm = ModuleSpec(module=LocalRMSNorm, params={"sequence_split": False})
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=LocalRMSNorm)


def build_gpt_model(
    hf_config,
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    config=None,
    make_vocab_size_divisible_by: int = 128,
    parallel_output: bool = True,
    **config_overrides: Any,
):
    """One ``GPTModel`` chunk for ``hf_config`` on this rank.

    ``config`` defaults to :func:`transformer_config_from_hf` with TP / PP read from
    ``megatron.core.parallel_state`` (which must be initialised). ``pre_process``
    (embedding) and ``post_process`` (final norm + output layer) say which ends of the
    pipeline this chunk holds; ``vp_stage`` is its virtual-pipeline stage (None without
    virtual PP). Params are initialised on CPU (``use_cpu_initialization``: the same
    values for any TP size) and cast to ``config.params_dtype``; on a GPU machine move
    the chunk with ``.cuda()`` before wrapping it in DDP, as Megatron-LM's get_model does.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if config is None:
        config = transformer_config_from_hf(
            hf_config,
            tp=parallel_state.get_tensor_model_parallel_world_size(),
            pp=parallel_state.get_pipeline_model_parallel_world_size(),
            ep=parallel_state.get_expert_model_parallel_world_size(),
            **config_overrides,
        )
    elif config_overrides:
        raise TypeError("pass either config or config overrides, not both")

    model = GPTModel(
        config=config,
        transformer_layer_spec=_local_spec(config, vp_stage),
        vocab_size=padded_vocab_size(
            hf_config.vocab_size, config.tensor_model_parallel_size, make_vocab_size_divisible_by
        ),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=rope_theta_of(hf_config),
        vp_stage=vp_stage,
    )
    if config.bf16 or config.fp16:
        # The norms (torch.nn.RMSNorm, LocalRMSNorm) are created in
        # torch's default dtype (fp32). Megatron-LM casts the whole module to 16 bits
        # (Float16Module: module.bfloat16()); do the same so every param, like every
        # tensor of the HF checkpoint, is params_dtype. RoPE's inv_freq is a plain
        # attribute, not a buffer, and stays fp32.
        model.to(dtype=config.params_dtype)
    return model


def build_model_chunks(hf_config, config=None, **kwargs) -> list:
    """All model chunks of this rank: one per virtual-pipeline stage (one without VPP).

    Each chunk gets the right ``pre_process`` / ``post_process`` from
    ``parallel_state``. ``kwargs`` go to :func:`build_gpt_model`.
    """
    from megatron.core import parallel_state

    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    stages = [None] if vpp is None else list(range(vpp))
    chunks = []
    for vp_stage in stages:
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        chunks.append(
            build_gpt_model(
                hf_config, pre_process=pre, post_process=post, vp_stage=vp_stage,
                config=config, **kwargs,
            )
        )
    return chunks


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """Strip wrappers (megatron DDP, Float16Module, torch DDP) that hold ``.module``."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def _strip_module_prefix(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _global_layer_index(chunk: torch.nn.Module) -> dict[int, int]:
    """Chunk-local ``decoder.layers`` index -> global layer index (0-based)."""
    inner = unwrap_model(chunk)
    decoder = getattr(inner, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        return {}
    # megatron-core numbers TransformerLayer.layer_number globally, from 1, taking
    # the PP stage and virtual-PP stage offsets into account.
    return {i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}


def megatron_param_name_map(model_chunks) -> dict[str, torch.nn.Parameter]:
    """Normalized name -> parameter, over all of this rank's model chunks.

    Names lose any number of leading "module." prefixes and carry global layer
    indices, e.g. ``decoder.layers.3.self_attention.linear_qkv.weight``. Shared
    parameters are listed once (``named_parameters`` deduplicates them).
    """
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    out: dict[str, torch.nn.Parameter] = {}
    for chunk in model_chunks:
        index = _global_layer_index(chunk)
        for raw, param in chunk.named_parameters():
            name = _strip_module_prefix(raw)
            m = _LAYER_RE.match(name)
            if m:
                local = int(m.group(1))
                name = f"decoder.layers.{index[local]}." + name[m.end():]
            if name in out and out[name] is not param:
                raise ValueError(f"two different parameters normalize to {name!r}")
            out[name] = param
    return out
