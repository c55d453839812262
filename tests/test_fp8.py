"""FP8 rollout checkpoints (fine-grained FP8, 128x128 blocks) as a residual conversion.

* The vectorised quantiser equals a loop-over-blocks reference written here (edge
  blocks, zeros, negatives, -0.0, tiny blocks, BF16 scales) and transformers' own
  `Fp8Quantize`; non-finite weights are refused by block.
* `FP8Block` over fused QKV, gated fc1 and row-parallel shards under TP sends exactly
  the reference quantisation of the reassembled canonical weights, each element
  once; coverage counts FP8 weights and scales as residual bytes; misaligned TP
  shards are refused at plan time, naming the parameter and the sizes.
* A change that moves a block's amax re-sends that block's changed FP8 elements and
  its scale (overwrite records), into a `TensorStoreRuntime` receiver.
* `TensorStoreRuntime` applies and reverts xor/add/overwrite in F8/F32 tensors; the HF
  receiver applies into transformers' `FP8Linear` storage built on CPU.
* End to end (multirank): Megatron TP=2 x DP=2 with the distributed optimizer refits a
  receiver process holding the FP8 checkpoint, bit-exact after every step.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nemo_dcr.converters.identity import IdentityConverter
from nemo_dcr.converters.llama import LlamaConverter, LlamaFP8Converter

from nemo_dcr import registry
from nemo_dcr.capture import torch_owned_ranges
from nemo_dcr.wire import codec
from nemo_dcr.converter import (
    ColumnParallel,
    Rule,
    ZeroCenteredNorm,
    check_exact_cover,
    coverage_report,
    coverage_runs,
    merge_runs,
    owned_intervals,
)
from nemo_dcr.errors import ApplyError, ConverterError
from nemo_dcr.fp8 import (
    FP8Block,
    dequantize_blocks,
    quantize_blocks,
    write_fp8_checkpoint,
)
from nemo_dcr.layout import LocalParam, OwnedRange, ParallelLayout
from nemo_dcr.placement import ResidualMap, merge_placed
from nemo_dcr.receiver import Receiver
from nemo_dcr.records import Op, Record
from nemo_dcr.runtimes.store import TensorStoreRuntime
from nemo_dcr.trainer import TrainerRefit
from nemo_dcr.verify import bit_mismatches
from tests.support.launch import REPO, TORCHRUN_TIMEOUT_S, torchrun, worker_env
from tests.test_placement import canonical_specs, hf_config, local_shapes, reassemble

FP8 = torch.float8_e4m3fn
LINEAR = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
          "gate_proj.weight", "up_proj.weight", "down_proj.weight")


# --- the reference quantiser: one block at a time, written from the format's definition ------

def reference_quantize(w: torch.Tensor, block=128, scale_dtype=torch.float32):
    """Per block (edge blocks hold fewer elements): amax = max |w| in float32; scale =
    448 * (1 / amax) (1 if amax is 0), at most FLT_MAX; stored scale_inv = 1 / scale,
    rounded to `scale_dtype` (BF16: the weights are then multiplied by 1 / stored value);
    q = e4m3fn(clamp(w * scale, -448, 448)). Scalar arithmetic is numpy float32 (IEEE,
    each operation correctly rounded), independent of how torch evaluates divisions."""
    bm, bn = (block, block) if isinstance(block, int) else block
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=FP8)
    s = torch.empty(-(-rows // bm), -(-cols // bn), dtype=scale_dtype)
    f32, big = np.float32, np.finfo(np.float32).max
    for i in range(0, rows, bm):
        for j in range(0, cols, bn):
            blk = w[i:i + bm, j:j + bn].to(torch.float32)
            amax = f32(blk.abs().max().item())
            with np.errstate(over="ignore"):
                scale = min(f32(1) if amax == 0 else (f32(1) / amax) * f32(448), big)
            inv = torch.tensor(f32(1) / scale).to(scale_dtype)
            if scale_dtype != torch.float32:
                with np.errstate(over="ignore", divide="ignore"):
                    scale = min(f32(1) / f32(inv.float().item()), big)
            s[i // bm, j // bn] = inv
            q[i:i + bm, j:j + bn] = torch.clamp(blk * float(scale), -448.0, 448.0).to(FP8)
    return q, s


def reference_fp8_state(dense: dict[str, torch.Tensor], block=128) -> dict[str, torch.Tensor]:
    """A dense canonical BF16 export as the FP8 checkpoint: in-layer linear weights
    quantised with `reference_quantize`, everything else as it is."""
    out = {}
    for name, t in dense.items():
        if name.startswith("model.layers.") and name.endswith(LINEAR):
            out[name], out[name + "_scale_inv"] = reference_quantize(t, block)
        else:
            out[name] = t
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# --- (a) the quantiser --------------------------------------------------------------------

def awkward_weight(rows, cols, seed):
    """Random bf16 with an all-zero block, negative blocks, a -0.0, huge and tiny blocks."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[:64, :64] = 0  # the first block of 64 all zero
    w[0:1, 0:1] = -0.0
    if rows > 64 and cols > 64:
        w[64:128, 64:128] = -w[64:128, 64:128].abs() * 1e3  # negative block, large magnitudes
    if cols > 128:
        w[:32, -1:] = 1e-37  # a tiny edge block: 448/amax overflows float32, the scale is capped
        w[:32, -2:-1] = -3e-38
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("rows,cols,block", [(256, 384, 128), (200, 300, 128), (129, 257, 128), (1, 1, 128),
                                             (96, 200, 64), (130, 70, (64, 32))])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_quantizer_equals_the_loop_over_blocks_reference(rows, cols, block, scale_dtype):
    w = awkward_weight(rows, cols, seed=rows * cols)
    q, s = quantize_blocks(w, block, scale_dtype)
    want_q, want_s = reference_quantize(w, block, scale_dtype)
    assert q.dtype == FP8 and s.dtype == scale_dtype and s.shape == want_s.shape
    assert same_bits(q, want_q) and same_bits(s, want_s)
    bm, bn = (block, block) if isinstance(block, int) else block
    assert not (bits(q[:64, :64]) & 0x7F).any()  # zeros stay (signed) zeros; -0.0 keeps its sign:
    assert bits(q)[0].item() == 0x80
    if bm <= 64 and bn <= 64 and rows >= bm and cols >= bn:
        assert s[0, 0].item() == 1.0  # an all-zero block stores scale_inv 1 (transformers' convention)
    assert torch.isfinite(q.float()).all() and torch.isfinite(s.float()).all()
    # Dequantised, every element is within e4m3's rounding of w (relative, or the block's subnormal step).
    step = s.float().repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:rows, :cols]
    err = (dequantize_blocks(q, s, block) - w.float()).abs()
    assert (err <= 0.1 * w.float().abs() + step * 2.0**-9).all()


def test_quantizer_equals_transformers_fp8_quantize():
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    hf = Fp8Quantize(types.SimpleNamespace(quantization_config=FineGrainedFP8Config()))
    for rows, cols in ((256, 384), (128, 128), (384, 256)):
        w = awkward_weight(rows, cols, seed=cols)
        want = hf.convert({"model.layers.0.mlp.up_proj.weight": w})
        q, s = quantize_blocks(w)
        assert same_bits(q, want["model.layers.0.mlp.up_proj.weight"])
        assert same_bits(s, want["model.layers.0.mlp.up_proj.weight_scale_inv"])


def test_quantizer_refuses_non_finite_weights_and_bad_shapes():
    w = torch.zeros(200, 300, dtype=torch.bfloat16)
    w[150, 290] = float("inf")
    with pytest.raises(ValueError, match=r"block \(1, 2\).*non-finite"):
        quantize_blocks(w)
    w[150, 290] = float("nan")
    with pytest.raises(ValueError, match=r"block \(1, 2\).*non-finite"):
        quantize_blocks(w)
    with pytest.raises(ValueError, match="2-D"):
        quantize_blocks(torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="block size"):
        quantize_blocks(torch.zeros(8, 8), block=0)


# --- FP8Block geometry under TP: the reassembled canonical weights, quantised -------------

def fp8_specs(c, block):
    """canonical_specs with the in-layer linear weights as FP8 + F32 scale_inv."""
    bm, bn = (block, block) if isinstance(block, int) else block
    out = {}
    for name, (dtype, shape) in canonical_specs(c).items():
        if name.startswith("model.layers.") and name.endswith(LINEAR):
            out[name] = ("F8_E4M3", shape)
            out[name + "_scale_inv"] = ("F32", (-(-shape[0] // bm), -(-shape[1] // bn)))
        else:
            out[name] = (dtype, shape)
    return out


geometries = st.fixed_dictionaries({
    "tp": st.sampled_from([1, 2, 4]),
    "groups_per_tp": st.integers(1, 2),
    "q_per_group": st.integers(1, 3),
    "block": st.sampled_from([2, 4, (4, 2), (2, 4)]),
    "head_dim": st.sampled_from([4, 8]),  # multiples of every block side: TP shards stay aligned
    "hidden": st.sampled_from([6, 8, 12]),  # not always a multiple: edge blocks
    "ffn_per_tp": st.sampled_from([4, 8]),
    "seed": st.integers(0, 2**31),
})


@settings(max_examples=12, deadline=None)
@given(geometries)
def test_fp8_block_sends_the_quantised_reassembly_exactly_once(g):
    tp, block = g["tp"], g["block"]
    c = hf_config(tp, g["groups_per_tp"], g["q_per_group"], g["head_dim"], g["hidden"], g["ffn_per_tp"],
                  20, 2, False, True)
    specs = fp8_specs(c, block)
    conv = LlamaConverter(c, fp8=True, fp8_block=block)
    gen = torch.Generator().manual_seed(g["seed"] % 2**31)
    padded = -(-c.vocab_size // (4 * tp)) * 4 * tp
    shapes = local_shapes(c, tp, 1, 0, padded)
    shards, placed, hits, runs, intervals = {}, {}, {}, [], []
    for t in range(tp):
        local = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}
        shards[t] = {n: v.view(torch.int16).numpy().view(np.uint16) for n, v in local.items()}
        params = [LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()]
        maps = conv.plan(params, ParallelLayout(tp_size=tp, tp_rank=t), specs)
        owned = [OwnedRange(p, 0, p.numel, None) for p in params]
        runs.append(coverage_runs(maps, owned, f"tp{t}"))
        intervals.append(owned_intervals(maps, owned))
        for name, m in maps.items():
            if not isinstance(m, ResidualMap):
                continue
            for values, omap in zip(m.compute(local[name]), m.outputs):
                for target, (pos, src) in merge_placed(omap.place(np.arange(omap.numel))).items():
                    dest = placed.setdefault(target, torch.zeros(int(np.prod(specs[target][1])), dtype=values.dtype))
                    dest[torch.from_numpy(pos.astype(np.int64))] = values[torch.from_numpy(src)]
                    hits.setdefault(target, np.zeros(dest.numel(), np.int64))
                    np.add.at(hits[target], pos.astype(np.int64), 1)
    canonical = reassemble(c, shards, tp, padded)
    fp8_names = [n for n, (d, _) in specs.items() if d == "F8_E4M3"]
    assert fp8_names and set(placed) == set(fp8_names) | {n + "_scale_inv" for n in fp8_names}
    for name in fp8_names:
        w = torch.from_numpy(canonical[name].view(np.int16)).view(torch.bfloat16)
        want_q, want_s = reference_quantize(w, block)
        for target, want in ((name, want_q), (name + "_scale_inv", want_s)):
            assert (hits[target] == 1).all(), f"{target}: not placed exactly once"
            assert same_bits(placed[target].view(want.shape), want), f"{target}: wrong bits"
    check_exact_cover(merge_runs(runs), {n: int(np.prod(s)) for n, (_, s) in specs.items()})
    report = coverage_report(specs, intervals)
    fp8_bytes = sum(int(np.prod(specs[n][1])) * (1 if specs[n][0] == "F8_E4M3" else 4) for n in placed)
    assert (report.residual_bytes, report.unplaced) == (fp8_bytes, ())
    assert report.affine_bytes == report.total_bytes - fp8_bytes


# --- (b) plan-time refusal --------------------------------------------------------------

def test_misaligned_tp_shards_are_refused_at_plan_time_naming_the_parameter():
    # 128-blocks, TP=2: q rows per rank = 2 groups x 2 heads x 16 = 64, not a multiple of 128.
    c = hf_config(2, 2, 2, 16, 256, 64, 30, 1, False, False)
    specs, shapes = fp8_specs(c, 128), local_shapes(c, 2, 1, 0, 32)
    params = [LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()]
    conv = registry.converter("qwen3-fp8", c)
    with pytest.raises(ConverterError, match=r"'decoder\.layers\.0\.self_attention\.linear_qkv\.weight' "
                                             r"\(local shape \(128, 256\), tp 1/2\).*rows \[64, 128\) x columns "
                                             r"\[0, 256\) of canonical 'model\.layers\.0\.self_attn\.q_proj\.weight' "
                                             r"\(128, 256\).*128x128 FP8 block"):
        conv.plan(params, ParallelLayout(tp_size=2, tp_rank=1), specs)
    # Row-parallel: o_proj columns [64, 128) on TP rank 1 (QKV aligned with 32-row blocks, columns not).
    with pytest.raises(ConverterError, match=r"'decoder\.layers\.0\.self_attention\.linear_proj\.weight'.*"
                                             r"columns \[64, 128\).*o_proj.*\(256, 128\).*32x128"):
        LlamaConverter(c, fp8=True, fp8_block=(32, 128)).plan(params, ParallelLayout(tp_size=2, tp_rank=1),
                                                                fp8_specs(c, (32, 128)))
    # The same model at TP=1 has edge blocks only: fine.
    c1 = hf_config(1, 2, 2, 16, 200, 100, 30, 1, False, False)
    maps = LlamaFP8Converter(c1).plan([LocalParam(n, s, torch.bfloat16) for n, s in
                                       local_shapes(c1, 1, 1, 0, 32).items()], ParallelLayout(), fp8_specs(c1, 128))
    assert sum(isinstance(m, ResidualMap) for m in maps.values()) == 4  # qkv, proj, fc1, fc2


def test_fp8_rules_check_the_checkpoint_and_have_no_inverse():
    c = hf_config(1, 1, 2, 4, 8, 4, 30, 1, False, False)
    shapes = local_shapes(c, 1, 1, 0, 32)
    params = [LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()]
    conv = LlamaConverter(c, fp8=True, fp8_block=4)
    with pytest.raises(ConverterError, match=r"linear_qkv.*'model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv' "
                                             "is not in the checkpoint"):
        conv.plan(params, ParallelLayout(), canonical_specs(c))  # a BF16 checkpoint
    specs = fp8_specs(c, 4)
    specs["model.layers.0.self_attn.k_proj.weight"] = ("BF16", specs["model.layers.0.self_attn.k_proj.weight"][1])
    with pytest.raises(ConverterError, match=r"linear_qkv.*k_proj\.weight' is BF16, not F8_E4M3"):
        conv.plan(params, ParallelLayout(), specs)
    specs = fp8_specs(c, 4)
    specs["model.layers.0.mlp.down_proj.weight_scale_inv"] = ("F32", (3, 1))
    with pytest.raises(ConverterError, match=r"linear_fc2.*down_proj\.weight_scale_inv' has shape \(3, 1\).*need \(2, 1\)"):
        conv.plan(params, ParallelLayout(), specs)
    with pytest.raises(ConverterError, match="inner mapping must be affine"):
        FP8Block(ZeroCenteredNorm())
    maps = conv.plan(params, ParallelLayout(), fp8_specs(c, 4), loading=True)
    assert maps["decoder.layers.0.mlp.linear_fc2.weight"].inverse is None  # loading goes through BF16
    assert [len(m.outputs) for m in maps.values() if isinstance(m, ResidualMap)] == [6, 2, 4, 2]


def test_registry_names_reach_the_fp8_table():
    c = hf_config(2, 1, 2, 4, 8, 3, 30, 2, False, True)
    for name in ("qwen3-fp8", "llama-fp8"):
        conv = registry.converter(name, c)
        assert isinstance(conv, LlamaFP8Converter) and conv.fp8 and conv.fp8_block == 128
    c.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64]}
    assert registry.converter("qwen3-fp8", c).fp8_block == [64, 64]
    assert not registry.converter("qwen3", c).fp8


# --- (c) a moved amax re-sends its block's FP8 elements and its scale ----------------------

pytestmark = pytest.mark.usefixtures("single_rank_group")


class OneLinear(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.proj = torch.nn.Parameter(w.clone())


def test_a_moved_amax_resends_the_block_and_its_scale(tmp_path):
    g = torch.Generator().manual_seed(3)
    w0 = (torch.randn(256, 384, generator=g) * 0.02).to(torch.bfloat16)  # 2 x 3 blocks
    specs = {"proj": ("F8_E4M3", (256, 384)), "proj_scale_inv": ("F32", (2, 3))}
    q0, s0 = reference_quantize(w0)
    store = TensorStoreRuntime({"proj": q0.clone(), "proj_scale_inv": s0.clone()})
    transport = registry.transport("local", {"dir": str(tmp_path / "shm"), "timeout_s": 20}, receivers=["rx0"])
    receiver = Receiver("rx0", store, transport.receiver("rx0"))
    thread = threading.Thread(target=receiver.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    model = OneLinear(w0)
    converter = IdentityConverter(None, rules=[Rule("proj", ("proj", "proj_scale_inv"), FP8Block(ColumnParallel()))])
    refit = TrainerRefit(converter, specs, torch_owned_ranges(model), ParallelLayout(), transport,
                         state_dir=str(tmp_path / "state"), timeout_s=20)
    sent = []
    real_send = refit.producer.end.send
    refit.producer.end.send = lambda tr, pid, data: (sent.append(bytes(data)), real_send(tr, pid, data))[1]
    try:
        with torch.no_grad():
            blk = model.proj[128:256, 128:256]  # block (1, 1)
            model.proj[200, 130] = blk.abs().max().float() * 3  # its new amax: every element re-scales
            model.proj[5, 300] = model.proj[5, 300] * 0.5  # block (0, 2): same amax unless it was the max
        result = refit.refit()
        assert result.decision.committed
        q1, s1 = reference_quantize(model.proj.detach())
        records = [r for data in sent for r in codec.decode(data).records]
        assert {r.op for r in records} == {Op.OVERWRITE}
        by_name = {r.name: r for r in records}
        changed_q = torch.nonzero(bits(q1) != bits(q0)).view(-1).numpy()
        changed_s = torch.nonzero(bits(s1).view(-1, 4).ne(bits(s0).view(-1, 4)).any(1)).view(-1).numpy()
        assert np.array_equal(by_name["proj"].positions, changed_q)
        assert np.array_equal(by_name["proj"].values, bits(q1).numpy()[changed_q])
        rows, cols = np.divmod(changed_q, 384)
        in_block = (rows >= 128) & (cols >= 128) & (cols < 256)
        assert in_block.sum() > 0.9 * 128 * 128 and set(zip(rows[~in_block], cols[~in_block])) <= {(5, 300)}
        assert 4 in changed_s.tolist()  # block (1, 1) of the 2 x 3 scale grid: its scale travels...
        assert np.array_equal(by_name["proj_scale_inv"].positions, changed_s)  # ...with only other moved scales
        assert np.array_equal(by_name["proj_scale_inv"].values, bits(s1).view(torch.int32).numpy().view(np.uint32)[changed_s])
        assert result.residual_elements == changed_q.size + changed_s.size
        assert bit_mismatches({"proj": q1, "proj_scale_inv": s1}, store.canonical_state()) == []
    finally:
        refit.close(shutdown_receivers=True)
        thread.join(timeout=10)
        receiver.end.close()
        transport.cleanup()


# --- receivers ----------------------------------------------------------------------------

def test_tensor_store_applies_and_reverts_f8_and_f32_records(tmp_path):
    q, s = quantize_blocks(awkward_weight(130, 200, 1))
    store = TensorStoreRuntime({"w": q.clone(), "w_scale_inv": s.clone(), "n": torch.ones(3, dtype=torch.bfloat16)})
    assert store.catalog() == {"w": ("F8_E4M3", (130, 200)), "w_scale_inv": ("F32", (2, 2)), "n": ("BF16", (3,))}
    pos = np.array([0, 7, 25_999], np.uint64)
    recs = [Record("w", "F8_E4M3", (130, 200), Op.XOR, pos, np.array([1, 0x80, 0x7F], np.uint8)),
            Record("w", "F8_E4M3", (130, 200), Op.OVERWRITE, pos[:1], np.array([0x38], np.uint8)),  # 1.0
            Record("w_scale_inv", "F32", (2, 2), Op.ADD, np.array([3], np.uint64), np.array([1], np.uint32))]
    log = store.apply(recs)
    w = bits(store.tensors["w"])
    assert w[0] == 0x38 and w[7] == bits(q)[7] ^ 0x80 and w[25_999] == bits(q)[25_999] ^ 0x7F
    assert store.tensors["w_scale_inv"].view(torch.int32)[1, 1] == s.view(torch.int32)[1, 1] + 1
    store.revert(log)
    assert same_bits(store.tensors["w"], q) and same_bits(store.tensors["w_scale_inv"], s)
    with pytest.raises(ApplyError, match="dtype BF16 but w is F8_E4M3"):
        store.apply([Record("w", "BF16", (130, 200), Op.XOR, pos, np.zeros(3, np.uint16))])
    shared = torch.zeros(8)
    with pytest.raises(ApplyError, match="'b' shares its storage with 'a'"):
        TensorStoreRuntime({"a": shared[:4], "b": shared[4:]})
    from safetensors.torch import save_file

    save_file({"w": q, "w_scale_inv": s}, tmp_path / "model.safetensors")
    loaded = TensorStoreRuntime.from_checkpoint(tmp_path)
    assert bit_mismatches({"w": q, "w_scale_inv": s}, loaded.canonical_state()) == []


def test_hf_runtime_applies_into_transformers_fp8_linear_on_cpu(tmp_path):
    """transformers 5.24 cannot load an FP8 checkpoint on CPU with FP8 storage
    (`from_pretrained` needs accelerate, then dequantises to BF16: see the design
    notes), but its `FP8Linear` modules can be built on CPU by hand: the HF receiver
    applies F8 and scale records into them bit-exactly, through load_state_dict."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear
    from transformers.utils.quantization_config import FineGrainedFP8Config

    from nemo_dcr.checkpoint import CheckpointReader
    from nemo_dcr.runtimes.hf import HFRuntime

    config = Qwen3Config(hidden_size=256, intermediate_size=384, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, vocab_size=300, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    write_fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8")
    quant = AutoConfig.from_pretrained(tmp_path / "fp8").quantization_config
    assert quant == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model = replace_with_fp8_linear(model, quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128)),
                                    pre_quantized=True, modules_to_not_convert=["lm_head"])
    model.to_empty(device="cpu")  # the FP8 modules are created on the meta device
    state = CheckpointReader(tmp_path / "fp8").state_dict()
    model.load_state_dict(state, strict=True)
    runtime = HFRuntime(model, checkpoint_dir=tmp_path / "fp8")
    assert runtime.catalog()["model.layers.0.mlp.down_proj.weight"] == ("F8_E4M3", (256, 384))
    assert runtime.catalog()["model.layers.0.mlp.down_proj.weight_scale_inv"] == ("F32", (2, 3))
    new_q, new_s = quantize_blocks(state["model.layers.0.mlp.down_proj.weight"].float() * 1.5)
    recs = []
    for name, new in (("model.layers.0.mlp.down_proj.weight", new_q), ("model.layers.0.mlp.down_proj.weight_scale_inv", new_s)):
        old = state[name]
        dt, shape = runtime.catalog()[name]
        width = old.element_size()
        changed = torch.nonzero(bits(new).view(-1, width).ne(bits(old).view(-1, width)).any(1)).view(-1).numpy()
        values = bits(new).numpy().view(f"<u{width}")[changed]
        recs.append(Record(name, dt, shape, Op.OVERWRITE, changed.astype(np.uint64), values))
    log = runtime.apply(recs)
    got = runtime.canonical_state()
    assert same_bits(got["model.layers.0.mlp.down_proj.weight"], new_q)
    assert same_bits(got["model.layers.0.mlp.down_proj.weight_scale_inv"], new_s)
    runtime.revert(log)
    assert bit_mismatches(state, {k: v for k, v in runtime.canonical_state().items()}) == []


# --- (d) end to end ----------------------------------------------------------------------

WORKER = REPO / "tests" / "workers" / "fp8_refit_worker.py"
RECEIVER = REPO / "tests" / "workers" / "fp8_receiver.py"


@pytest.mark.multirank
@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 60)
def test_megatron_refits_an_fp8_receiver_bit_exactly(tmp_path):
    from nemo_dcr.checkpoint import CheckpointReader
    from nemo_dcr.cli import make_checkpoint

    # Every TP=2 shard is 128-aligned: q 256 / k, v 128 rows per rank, o_proj 256 and
    # down_proj 512 columns per rank, gate/up 512 rows per rank.
    make_checkpoint(tmp_path / "bf16", family="qwen3", hidden=512, layers=2, heads=8, kv_heads=4, ffn=1024,
                    vocab=384, seed=1)
    write_fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8")
    want = reference_fp8_state(CheckpointReader(tmp_path / "bf16").state_dict())
    assert bit_mismatches(want, CheckpointReader(tmp_path / "fp8").state_dict()) == []  # version 0
    transport_config = json.dumps({"dir": str(tmp_path / "shm"), "timeout_s": 120})
    receiver = subprocess.Popen([sys.executable, str(RECEIVER), "--checkpoint", str(tmp_path / "fp8"), "--id", "rx0",
                                 "--transport-config", transport_config],
                                cwd=REPO, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = torchrun(4, WORKER, "--bf16", str(tmp_path / "bf16"), "--fp8", str(tmp_path / "fp8"), "--tp", "2",
                       "--steps", "3", "--transport-config", transport_config, "--state-dir", str(tmp_path / "state"),
                       ok_marker="[fp8_refit] OK")
        assert out.count("bit-exact") == 3, out[-3000:]
        assert "0.0% affine" not in out and "% residual; FP8 residuals produced per rank" in out
        rx_out, _ = receiver.communicate(timeout=60)
        assert receiver.returncode == 0 and "shut down at version 3" in rx_out, rx_out[-3000:]
        assert "F8_E4M3" in rx_out and "F32" in rx_out
    finally:
        if receiver.poll() is None:
            receiver.kill()
