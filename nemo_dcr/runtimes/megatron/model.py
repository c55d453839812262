"""Build a megatron-core ``GPTModel`` that matches a Hugging Face Llama / Mistral / Qwen2 /
Qwen3 / Qwen3-MoE / Mixtral config.

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
intermediate_size      ffn_hidden_size; gated_linear_unit=True
hidden_act             activation=silu; anything else refused
rms_norm_eps           layernorm_epsilon, normalization="RMSNorm"
model_type             one of SUPPORTED_MODEL_TYPES, else refused (e.g. phi3, gemma)
model_type == qwen3    qk_layernorm=True (q_norm / k_norm over head_dim)
model_type == qwen2    add_qkv_bias=True (Qwen2 always biases q/k/v, not o_proj)
attention_bias         refused if True (Llama / Qwen3 bias o_proj too); no other biases
mlp_bias               refused if True
rope_theta             rotary_base; rope, non-interleaved (HF ``rotate_half``)
rope_parameters /      rope type "default" only: llama3, yarn, longrope, dynamic, linear...
  rope_scaling         refused (either field, transformers 5.x / 4.x)
partial_rotary_factor  rotary_percent=1.0: anything but 1.0 refused (also inside
                       rope_parameters / rope_scaling)
sliding_window         refused where applied: when set (Mistral, Mixtral, Phi-3), or with
                       use_sliding_window=True (Qwen2 / Qwen3 keep a size while it is off)
layer_types            every entry "full_attention", else refused
attention_dropout      attention_dropout; other dropouts (resid_pdrop, embd_pdrop) are
                       training-only, not refused, not modelled (hidden_dropout=0)
tie_word_embeddings    share_embeddings_and_output_weights; must be set (True / False)
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
decoder_sparse_step,   refused unless 1 / empty (dense layers between MoE layers);
  mlp_only_layers      shared_expert_intermediate_size refused
head_dim / GQA         head_dim even and positive, num_key_value_heads divides heads
(other families)       attn_logit_softcapping, final_logit_softcapping,
                       use_bidirectional_attention, query_pre_attn_scalar != head_dim
=====================  ==========================================================

:func:`check_supported` makes the refusals: one :class:`~nemo_dcr.errors.Unsupported` lists
every field the builder does not model, with its value and why, before megatron-core is
needed. It refuses what would change the function the weights compute or their layout,
not training-only settings (dropouts, init, aux-loss coefficients; Mixtral's
router_jitter_noise is the exception, as Megatron's jitter is another one).

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
    "SUPPORTED_MODEL_TYPES",
    "check_supported",
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


# What the builder models; the per-family differences it sets are in transformer_config_from_hf.
# Mistral is Llama's layers (a sliding window is refused below).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
_MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
_ROPE_FIELDS = ("rope_parameters", "rope_scaling")  # transformers 5.x, 4.x (5.x keeps both names)

# Fields of other families' configs that change the function, refused unless None / False / 0.
_FOREIGN_FIELDS = {
    "attn_logit_softcapping": "attention-logit soft-capping is not modelled",
    "final_logit_softcapping": "final-logit soft-capping is not modelled",
    "use_bidirectional_attention": "only causal attention is modelled",
    "shared_expert_intermediate_size": "shared experts are not modelled",
}


def check_supported(hf_config) -> None:
    """Raise :class:`Unsupported` naming every field of ``hf_config`` the builder does not model.

    One error lists all problems, each as ``<ConfigClass>.<field>=<value>: why``: a model
    built anyway would compute another function than the checkpoint's, or hold its weights
    in another layout. Needs neither megatron-core's parallel state nor a GPU.

    Training-only settings are not refused, as they leave the meaning of the weights alone:
    ``attention_dropout`` is carried over, other dropouts (``resid_pdrop``, ``embd_pdrop``)
    are not modelled (hidden_dropout=0), nor are ``initializer_range`` or router aux-loss
    coefficients. Mixtral's ``router_jitter_noise`` is the exception: Megatron's jitter is
    another one, so the training would not be the one asked for.
    """
    problems = _problems(hf_config)
    if problems:
        raise Unsupported(f"the Megatron builder does not model this {type(hf_config).__name__} "
                          f"({len(problems)} problem(s)):\n  - " + "\n  - ".join(problems))


def _rope_dicts(hf_config):
    for field in _ROPE_FIELDS:
        params = getattr(hf_config, field, None)
        if params:
            yield field, params


def _problems(c) -> list[str]:
    name, out = type(c).__name__, []

    def bad(field, value, why):
        out.append(f"{name}.{field}={value!r}: {why}")

    model_type = getattr(c, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = "; Phi-3's checkpoint packs qkv_proj and gate_up_proj" if model_type == "phi3" else ""
        bad("model_type", model_type, f"not a family the builder models ({', '.join(SUPPORTED_MODEL_TYPES)}){hint}")
    for field in ("hidden_act", "hidden_activation"):  # Gemma2 names it hidden_activation
        act = getattr(c, field, None)
        if act is not None and act not in ("silu", "swish"):  # the same function in transformers
            bad(field, act, "only SwiGLU (silu) MLPs are modelled")

    # RoPE: plain (unscaled) over the whole head, base rope_theta.
    for field, params in _rope_dicts(c):  # report once: 5.x's rope_scaling is rope_parameters
        key = "rope_type" if "rope_type" in params else "type"
        if (params.get(key) or "default") != "default":
            bad(f"{field}[{key!r}]", params[key], "only plain RoPE is modelled (no scaling / long-context "
                "variant): the rotary frequencies would differ from the checkpoint's")
            break
    factors = [("partial_rotary_factor", getattr(c, "partial_rotary_factor", None))]
    factors += [(f"{f}['partial_rotary_factor']", p.get("partial_rotary_factor")) for f, p in _rope_dicts(c)]
    for field, factor in factors:
        if factor is not None and float(factor) != 1.0:
            bad(field, factor, "partial rotary embeddings are not modelled (Megatron gets rotary_percent=1.0); "
                "the built model would differ from the checkpoint")
            break

    # Attention: full causal attention over every layer.
    window = getattr(c, "sliding_window", None)
    if hasattr(c, "use_sliding_window"):
        # Qwen2 / Qwen3 configs keep a window size while the flag is off: only the flag turns it on.
        if c.use_sliding_window and window is not None:
            bad("use_sliding_window", c.use_sliding_window,
                f"sliding-window attention (sliding_window={window}) is not modelled")
    elif window is not None:  # Mistral, Mixtral, Phi-3, Gemma2: a size means on
        bad("sliding_window", window, "sliding-window attention is not modelled")
    kinds = sorted(set(getattr(c, "layer_types", None) or ()) - {"full_attention"})
    if kinds:
        out.append(f"{name}.layer_types holds {kinds}: only full attention in every layer is modelled")
    for field, why in _FOREIGN_FIELDS.items():
        if getattr(c, field, None):
            bad(field, getattr(c, field), why)
    head_dim = _head_dim_of(c) if hasattr(c, "hidden_size") and hasattr(c, "num_attention_heads") else None
    scalar = getattr(c, "query_pre_attn_scalar", None)
    if scalar is not None and scalar != head_dim:
        bad("query_pre_attn_scalar", scalar, f"the attention scale 1/sqrt(head_dim={head_dim}) is modelled")
    if head_dim is not None and (head_dim <= 0 or head_dim % 2):
        bad("head_dim", head_dim, "must be positive and even: RoPE rotates pairs of channels")
    heads = getattr(c, "num_attention_heads", None)
    groups = getattr(c, "num_key_value_heads", None) or heads
    if heads and groups and heads % groups:
        bad("num_key_value_heads", groups, f"does not divide num_attention_heads={heads} (GQA groups)")

    # Biases: Qwen2's q/k/v bias only (add_qkv_bias, set by model_type).
    if getattr(c, "attention_bias", False):
        # Llama / Qwen3 / Qwen3-MoE bias o_proj too; Megatron has that bias only together with MLP
        # biases (add_bias_linear).
        bad("attention_bias", c.attention_bias, "biases o_proj as well as q/k/v, which is not modelled")
    if getattr(c, "mlp_bias", False):
        bad("mlp_bias", c.mlp_bias, "MLP biases are not modelled")

    # The output layer: shared with the embedding or not, never guessed (defaults differ by version).
    tied = getattr(c, "tie_word_embeddings", None)
    if tied not in (True, False):
        bad("tie_word_embeddings", tied, "must be True or False: it decides whether output_layer is a weight")

    # MoE: every layer sparse, no shared experts, top-k softmax routing.
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if model_type in _MOE_MODEL_TYPES and not experts:
        bad("num_experts", experts, f"a {model_type} model needs experts; a dense model would be built")
    if getattr(c, "decoder_sparse_step", 1) != 1:
        bad("decoder_sparse_step", c.decoder_sparse_step, "dense layers between MoE layers are not modelled")
    if getattr(c, "mlp_only_layers", None):
        bad("mlp_only_layers", c.mlp_only_layers, "dense layers between MoE layers are not modelled")
    # Training-only, but HF's jitter multiplies the experts' inputs too; Megatron's
    # moe_input_jitter_eps only jitters the router's input: not the same model to train.
    if float(getattr(c, "router_jitter_noise", 0.0) or 0.0) != 0.0:
        bad("router_jitter_noise", c.router_jitter_noise, "only 0 is modelled")
    return out


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
    """A ``TransformerConfig`` for ``hf_config`` (see ``SUPPORTED_MODEL_TYPES``) at TP ``tp``
    × PP ``pp`` (× EP ``ep`` for MoE).

    :func:`check_supported` runs first. Dropout is taken from the HF config
    (attention_dropout; hidden_dropout is 0: no hidden dropout in Llama / Qwen). All
    CUDA-only fusions are off so the config also runs on CPU; pass ``overrides`` (any
    TransformerConfig field) to turn them on for GPU runs, or to set e.g.
    ``virtual_pipeline_model_parallel_size``.

    ``sequence_parallel=True`` works with :func:`build_gpt_model`'s norms (see
    :class:`LocalRMSNorm`); MoE layers with TP > 1 need it to train.
    """
    from megatron.core.transformer import TransformerConfig

    check_supported(hf_config)
    model_type = hf_config.model_type
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
        # Qwen2's config has no attention_bias flag: its q/k/v projections always carry one.
        add_qkv_bias=model_type == "qwen2",
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
    """TransformerConfig MoE fields for a Qwen3-MoE or Mixtral config ({} for dense models);
    :func:`check_supported` has refused what they cannot express."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if not experts:
        return {}
    model_type = getattr(hf_config, "model_type", "")
    if model_type == "qwen3_moe":
        expert_ffn = hf_config.moe_intermediate_size
        pre_softmax = not bool(getattr(hf_config, "norm_topk_prob", True))
    elif model_type == "mixtral":
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
    check_supported(hf_config)  # also when config was built elsewhere: the fields below are the HF config's
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
