"""Residual conversions: values that are not bit copies of training elements.

* Loading through a residual's inverse gives the same shards as the affine path
  (fused QKV) or the zero-centred values (norms), and a value the trainer cannot
  hold fails closed.
* Start-up checks name a residual whose outputs do not fit its declaration.
* Coverage counts residual bytes as residual; exact cover sees residual owners.
* End to end without Megatron: a Hugging Face model trained with zero-centred norms
  (`torch.nn.utils.parametrize`: the module applies 1 + w, the optimizer updates w)
  refits real receivers over the local transport; the norms travel as overwrites of
  the recomputed 1 + w, everything else as xor, and an aborted transfer leaves the
  residual baseline at the committed version.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch.nn.utils import parametrize
from transformers import AutoModelForCausalLM, LlamaConfig

from nemo_dcr import registry
from nemo_dcr.baseline import Baseline
from nemo_dcr.capture import torch_owned_ranges
from nemo_dcr.checkpoint import read_specs
from nemo_dcr.wire import codec
from nemo_dcr.converter import (
    Context,
    Replicated,
    Rule,
    ValueTransform,
    ZeroCenteredNorm,
    check_exact_cover,
    coverage_report,
    coverage_runs,
    merge_runs,
    owned_intervals,
    plan_param,
)
from nemo_dcr.converters.identity import IdentityConverter
from nemo_dcr.converters.llama import LlamaConverter, LlamaQKVResidualConverter
from nemo_dcr.errors import ConverterError, TransferFailed
from nemo_dcr.layout import LocalParam, OwnedRange, ParallelLayout
from nemo_dcr.placement import ResidualMap
from nemo_dcr.receiver import Receiver
from nemo_dcr.records import Op
from nemo_dcr.runtimes.hf import HFRuntime
from nemo_dcr.runtimes.megatron.load import load_into
from nemo_dcr.sender import Producer
from nemo_dcr.trainer import TrainerRefit
from nemo_dcr.verify import bit_mismatches
from tests.test_placement import canonical_specs, hf_config, local_shapes


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def canonical_tensors(specs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (_, shape) in specs.items():
        t = torch.randn(shape, generator=gen)
        out[name] = (1 + 0.05 * t if name.endswith("norm.weight") else t).to(torch.bfloat16)
    return out


def load(converter, c, specs, canon, tp, t):
    shapes = local_shapes(c, tp, 1, 0, -(-c.vocab_size // (4 * tp)) * 4 * tp)
    params = {n: torch.full(s, 7.0, dtype=torch.bfloat16) for n, s in shapes.items()}
    maps = converter.plan([LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()],
                          ParallelLayout(tp_size=tp, tp_rank=t), specs, loading=True)
    load_into(params, maps, canon.__getitem__)
    return params, maps


@pytest.mark.parametrize("tp,qkv_bias,qk_norm", [(1, False, True), (2, True, False), (4, True, True)])
def test_residual_qkv_and_zero_centered_norms_load_through_their_inverse(tp, qkv_bias, qk_norm):
    c = hf_config(tp, 1, 2, 4, 8, 3, 30, 2, False, qk_norm, qkv_bias)
    specs = canonical_specs(c)
    canon = canonical_tensors(specs)
    for t in range(tp):
        affine, _ = load(LlamaConverter(c), c, specs, canon, tp, t)
        residual, maps = load(LlamaConverter(c, qkv_as_residual=True, zero_centered_norms=True),
                              c, specs, canon, tp, t)
        assert any(isinstance(m, ResidualMap) and "QKV" in m.kind for m in maps.values())
        for name, want in affine.items():
            if name.endswith("layernorm.weight"):  # stored zero-centred: w = x - 1
                assert bits_equal(residual[name], want - 1), name
                assert bits_equal(residual[name] + 1, want), name
            else:  # fused QKV through the residual inverse: the same shard as the affine load
                assert bits_equal(residual[name], want), name


def test_a_value_the_trainer_cannot_hold_fails_closed_at_load():
    c = hf_config(1, 1, 2, 4, 8, 3, 30, 2, False, True)
    specs = canonical_specs(c)
    canon = canonical_tensors(specs)
    canon["model.norm.weight"][3] = 258.0  # bf16: 258 - 1 rounds to 256, and 1 + 256 back to 256
    with pytest.raises(ConverterError, match=r"decoder\.final_layernorm.*1 element.*model\.norm\.weight.*round trip"):
        load(LlamaConverter(c, zero_centered_norms=True), c, specs, canon, 1, 0)
    no_inverse = IdentityConverter(None, rules=[Rule("w", ("w",), ValueTransform(Replicated(), torch.exp))])
    maps = no_inverse.plan([LocalParam("w", (4,), torch.bfloat16)], ParallelLayout(), {"w": ("BF16", (4,))},
                           loading=True)
    with pytest.raises(ConverterError, match="^w: .*no inverse"):
        load_into({"w": torch.zeros(4, dtype=torch.bfloat16)}, maps, lambda n: torch.ones(4, dtype=torch.bfloat16))


def test_residual_outputs_are_checked_at_start_up():
    specs = {"w": ("BF16", (4, 3))}
    ctx = Context(LocalParam("norm.w", (4, 3), torch.bfloat16), ParallelLayout(), ("w",), specs, None)
    with pytest.raises(ConverterError, match=r"'norm\.w'.*output 0 is torch\.float32, canonical is BF16"):
        plan_param(ValueTransform(Replicated(), lambda w: w.float() + 1), ctx)
    with pytest.raises(ConverterError, match=r"'norm\.w'.*output 0 has 9 elements, expected 12"):
        plan_param(ValueTransform(Replicated(), lambda w: w[1:]), ctx)
    with pytest.raises(ConverterError, match=r"'norm\.w'.*forward fails"):
        plan_param(ValueTransform(Replicated(), lambda w: w.reshape(5, -1)), ctx)
    m = plan_param(ZeroCenteredNorm(), ctx)
    assert isinstance(m, ResidualMap) and m.dtypes == ("BF16",) and m.key(0) == "residual:w[0+1x12/0]"
    # Replicated over TP: only TP rank 0's position produces; every rank loads.
    ctx1 = Context(ctx.param, ParallelLayout(tp_size=2, tp_rank=1), ("w",), specs, None)
    assert not plan_param(ZeroCenteredNorm(), ctx1).produces
    assert plan_param(ZeroCenteredNorm(), ctx1, loading=True).produces


def test_registry_names_and_options_reach_the_residual_table():
    c = hf_config(2, 1, 2, 4, 8, 3, 30, 2, False, True)
    for conv in (registry.converter("qwen3-qkv-residual", c), registry.converter("qwen3", c, qkv_as_residual=True)):
        assert isinstance(conv, LlamaConverter) and conv.qkv_as_residual
    assert isinstance(registry.converter("llama-qkv-residual", c), LlamaQKVResidualConverter)
    assert not registry.converter("qwen3", c).qkv_as_residual


def test_coverage_counts_residual_bytes_and_cover_sees_residual_owners():
    c = hf_config(2, 1, 2, 4, 8, 3, 30, 2, False, True)
    specs = canonical_specs(c)
    shapes = local_shapes(c, 2, 1, 0, 32)
    conv = LlamaConverter(c, qkv_as_residual=True)
    numels = {n: int(np.prod(s)) for n, (_, s) in specs.items()}
    runs, intervals = [], []
    for t in range(2):
        params = [LocalParam(n, s, torch.bfloat16) for n, s in shapes.items()]
        maps = conv.plan(params, ParallelLayout(tp_size=2, tp_rank=t), specs)
        # Two DP ranks split every parameter in half: the one holding element 0 produces residuals.
        for dp in range(2):
            owned = [OwnedRange(p, dp * p.numel // 2, (dp + 1) * p.numel // 2, None) for p in params]
            runs.append(coverage_runs(maps, owned, f"tp{t}/dp{dp}"))
            intervals.append(owned_intervals(maps, owned))
            qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
            produced = any("q_proj" in n for n in runs[-1])
            assert produced == (dp == 0), (t, dp)
            n = maps[qkv].numel
            assert maps[qkv].produced_by(dp * n // 2, (dp + 1) * n // 2) == (dp == 0)
    check_exact_cover(merge_runs(runs), numels)
    report = coverage_report(specs, intervals)
    qkv_bytes = 2 * sum(numels[n] for n in specs if any(f"{x}_proj.weight" in n for x in "qkv"))
    assert (report.residual_bytes, report.affine_bytes + report.residual_bytes) == (qkv_bytes, report.total_bytes)
    assert not report.unplaced and f"{100 * qkv_bytes / report.total_bytes:.1f}% residual" in str(report)
    with pytest.raises(ConverterError, match=r"q_proj.*owned twice.*\(residual\)"):
        check_exact_cover(merge_runs(runs + [{n: r for n, r in runs[0].items() if "q_proj" in n}]), numels)
    with pytest.raises(ConverterError, match="owned by no rank"):
        check_exact_cover(merge_runs(runs[:2]), numels)  # TP rank 1's position missing


def test_the_producing_rank_reads_the_whole_parameter_through_its_owned_view():
    specs = {"w": ("BF16", (8,))}
    lp = LocalParam("w", (8,), torch.bfloat16)
    maps = IdentityConverter(None, rules=[Rule("w", ("w",), ZeroCenteredNorm())]).plan([lp], ParallelLayout(), specs)
    param = torch.linspace(-0.5, 0.5, 8).to(torch.bfloat16)
    first_half = OwnedRange(lp, 0, 4, param.view(-1)[:4])  # live view: reaches elements 4..7 too
    baseline = Baseline()
    producer = Producer("p0", [first_half], maps, specs, baseline, None)
    assert list(baseline.keys()) == ["residual:w[0+1x8/0]"]
    assert bits_equal(baseline.committed("residual:w[0+1x8/0]").view(torch.bfloat16), param + 1)
    assert producer.owned == [first_half] and not producer.affine
    # The other DP rank's half produces nothing; a copied range cannot reach the rest.
    assert Producer("p1", [OwnedRange(lp, 4, 8, param.view(-1)[4:])], maps, specs, Baseline(), None).owned == []
    copied = OwnedRange(lp, 0, 4, param[:4].clone())
    with pytest.raises(ConverterError, match=r"w\[0:4\] is not a view.*pass params="):
        Producer("p0", [copied], maps, specs, Baseline(), None)
    assert Producer("p0", [copied], maps, specs, Baseline(), None, params={"w": param}).residuals


# --- end to end: zero-centred norms in a plain-PyTorch trainer ---------------------------

ZC = ".parametrizations.weight.original"


class OnePlus(torch.nn.Module):
    """The module applies 1 + w; the optimizer updates w (Megatron's zero-centred gamma)."""

    def forward(self, w):
        return w + 1

    def right_inverse(self, x):
        return x - 1


def zero_centered_converter(config):
    return IdentityConverter(config, rules=[
        Rule("model.layers.{L}.input_layernorm" + ZC, ("model.layers.{L}.input_layernorm.weight",), ZeroCenteredNorm()),
        Rule("model.layers.{L}.post_attention_layernorm" + ZC, ("model.layers.{L}.post_attention_layernorm.weight",),
             ZeroCenteredNorm()),
        Rule("model.norm" + ZC, ("model.norm.weight",), ZeroCenteredNorm()),
    ])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt-zc")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():  # norms at exactly 1.0 would hardly move 1 + w at these step counts
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return path


pytestmark = pytest.mark.usefixtures("single_rank_group")


def zero_centered_trainer(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    for module in list(model.modules()):
        if type(module).__name__.endswith("RMSNorm"):
            parametrize.register_parametrization(module, "weight", OnePlus())
    return model


def dense_export(model):
    """What a dense refit would send: canonical names, 1 + w for the zero-centred norms."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith(ZC):
            out[name[: -len(ZC)] + ".weight"] = model.get_submodule(name[: -len(ZC)]).weight.detach()
        else:
            out[name] = p.detach()
    return out


def test_zero_centered_norms_refit_bit_exact_as_overwrites(checkpoint, tmp_path):
    transport = registry.transport("local", {"dir": str(tmp_path / "shm"), "timeout_s": 20}, receivers=["rx0"])
    rx_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    receiver = Receiver("rx0", HFRuntime(rx_model, checkpoint_dir=checkpoint), transport.receiver("rx0"))
    thread = threading.Thread(target=receiver.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    model = zero_centered_trainer(checkpoint)
    assert bit_mismatches(dense_export(model), receiver.runtime.canonical_state()) == []  # round trip exact
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    specs = read_specs(checkpoint)
    refit = TrainerRefit(zero_centered_converter(model.config), specs, torch_owned_ranges(model), ParallelLayout(),
                         transport, state_dir=str(tmp_path / "state"), max_payload_elements=2000, timeout_s=20)
    sent = []
    real_send = refit.producer.end.send
    refit.producer.end.send = lambda tr, pid, data: (sent.append(bytes(data)), real_send(tr, pid, data))[1]

    def step():
        ids = torch.randint(0, 300, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    try:
        report = coverage_report(specs, [owned_intervals(refit.producer.maps, refit.producer.owned)])
        norm_bytes = 2 * sum(int(np.prod(s)) for n, (_, s) in specs.items() if "norm" in n)
        assert (report.residual_bytes, report.unplaced) == (norm_bytes, ())
        residual_keys = [k for k in refit.baseline.keys() if k.startswith("residual:")]
        assert len(residual_keys) == 5  # 2 layers x 2 norms + the final norm

        # An aborted transfer leaves the residual baseline at the committed version...
        step()
        before = {k: refit.baseline.committed(k).clone() for k in residual_keys}
        limit, receiver.max_staged_bytes = receiver.max_staged_bytes, 1  # refuses every payload
        with pytest.raises(TransferFailed, match="max_staged_bytes"):
            refit.refit()
        receiver.max_staged_bytes = limit
        assert all(torch.equal(refit.baseline.committed(k), v) for k, v in before.items())
        # ...so the next transfers still bring the receiver to the trainer's 1 + w, bit for bit.
        residual_sent = 0
        for version in (1, 2, 3):
            step()
            sent.clear()
            result = refit.refit()
            assert result.decision.committed and result.decision.version == version
            assert bit_mismatches(dense_export(model), receiver.runtime.canonical_state()) == []
            ops = {}
            for data in sent:
                for rec in codec.decode(data).records:
                    ops.setdefault(rec.name, set()).add(rec.op)
            assert all(o == {Op.OVERWRITE} for n, o in ops.items() if "norm" in n), ops
            # the rest as deltas: the default op "auto" takes xor or add per tensor and payload
            assert all(o and o <= {Op.XOR, Op.ADD} for n, o in ops.items() if "norm" not in n), ops
            assert result.residual_elements == result.metrics()["residual_changed_elements"]
            residual_sent += result.residual_elements
        assert residual_sent > 0  # some 1 + w changed its bf16 bits and travelled as an overwrite
    finally:
        refit.close(shutdown_receivers=True)
        thread.join(timeout=10)
        receiver.end.close()
        transport.cleanup()
