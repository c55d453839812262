"""Megatron-inference receivers: canonical records applied in place into a Megatron
GPTModel through the converter's loading plan.

Unit level (one process, TP=1 x PP=1 under a single-rank gloo group): xor / add /
overwrite records land bit-exactly and revert; residual rules fail closed for deltas
and take overwrites; vocab padding is never written; a receiver holding a subset of
the model skips records of tensors it does not hold and still rejects unknown names.
Oracles: the expected canonical bits computed in numpy from the old bits, and
`tests/support/reference_export.py` (an independent dense export of the model).

Multirank: a Megatron trainer (TP=2, distributed optimizer) refits a Megatron-inference
job with another layout (TP=2 x PP=2, tied embeddings: the last stage holds a copy of the
embedding) running as its own torchrun job, one receiver per inference rank; after every
step the inference job's dense export equals the trainer's, digest for digest, and every
rank's held canonical slices equal the same slices of the trainer's export. The trainer
sends fused QKV as a residual (overwrites) and everything else as xor; the inference ranks
of stage 0 load fused QKV through the residual rule (dense overwrite into a TP shard),
those of stage 1 through the affine table (masked overwrite of the shard's blocks).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from nemo_dcr import dtypes, registry
from nemo_dcr.checkpoint import CheckpointReader, read_specs
from nemo_dcr.errors import ApplyError
from nemo_dcr.layout import ParallelLayout
from nemo_dcr.records import Op, Record
from nemo_dcr.verify import bit_mismatches
from tests.support.launch import TORCHRUN_TIMEOUT_S
from tests.support.megatron_jobs import check_exports, trainer_refits_inference
from tests.support.records import records_for

pytestmark = pytest.mark.usefixtures("single_rank_group")

VOCAB = 300  # padded to 384 rows by Megatron (TP=1): 84 padding rows in embedding and output layer
BF16_SPECIALS = [0x7FC0, 0x7FC1, 0xFFFF, 0x7F81, 0x8000, 0x0000, 0x7F80, 0xFF80, 0x0001]
Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from nemo_dcr.cli import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), family="qwen3", hidden=64, layers=2, heads=4,
                           kv_heads=2, ffn=128, vocab=VOCAB, seed=3)


@pytest.fixture(scope="module")
def megatron(single_rank_group):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()


def build(checkpoint, **options):
    """A TP=1 x PP=1 Megatron GPT loaded from the checkpoint, and its runtime."""
    from transformers import AutoConfig

    from nemo_dcr.runtimes.megatron import build_model_chunks, transformer_config_from_hf
    from nemo_dcr.runtimes.megatron.receiver import MegatronRuntime

    cfg = AutoConfig.from_pretrained(checkpoint)
    torch.manual_seed(0)
    chunks = build_model_chunks(cfg, transformer_config_from_hf(cfg, tp=1, pp=1))
    runtime = MegatronRuntime(chunks, registry.converter("qwen3", cfg, **options), read_specs(checkpoint),
                              ParallelLayout())
    runtime.load_checkpoint(CheckpointReader(checkpoint).get)
    return cfg, chunks, runtime


def export(chunks, cfg) -> dict[str, torch.Tensor]:
    from tests.support.reference_export import reference_export

    return reference_export(chunks, cfg)


def flat_bits(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    out = {}
    for name, t in state.items():
        d = dtypes.from_torch(t.dtype)
        out[name] = dtypes.bits_of(t.detach().contiguous()).view(-1).numpy().view(d.bits_numpy).copy()
    return out


def as_tensors(bits: dict[str, np.ndarray], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(bits[n].view(np.int16).copy()).view(torch.bfloat16).view(like[n].shape)
            for n in bits}


def perturb(old: dict[str, np.ndarray], seed: int, frac=0.02) -> dict[str, np.ndarray]:
    """~2% of the elements of every other tensor (and the embedding, the output layer and a
    norm) move by +-1 ULP, plus odd bit patterns (NaN payloads, -0.0, infinities)."""
    rng = np.random.default_rng(seed)
    new = {n: v.copy() for n, v in old.items()}
    names = sorted(new)
    for name in sorted(set(names[::2]) | {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}):
        v = new[name]
        k = max(1, int(v.size * frac))
        pos = rng.choice(v.size, size=k, replace=False)
        v[pos] = v[pos] + rng.choice(np.array([1, 0xFFFF], dtype=v.dtype), size=k)
        sp = rng.choice(v.size, size=min(len(BF16_SPECIALS), v.size), replace=False)
        v[sp] = np.array(BF16_SPECIALS[: sp.size], dtype=np.uint16)
    return new


def padding_rows(chunks) -> list[torch.Tensor]:
    m = chunks[0]
    return [m.embedding.word_embeddings.weight[VOCAB:], m.output_layer.weight[VOCAB:]]


# -- unit level ---------------------------------------------------------------------------

def test_load_and_catalog(checkpoint, megatron):
    cfg, chunks, rt = build(checkpoint)
    specs = read_specs(checkpoint)
    assert rt.catalog() == specs and rt.held == set(specs) and rt.whole == set(specs)  # TP=1: all, whole
    assert rt.canonical_catalog == specs
    want = CheckpointReader(checkpoint).state_dict()
    assert bit_mismatches(want, rt.canonical_state()) == []
    assert bit_mismatches(want, export(chunks, cfg)) == []  # the independent oracle agrees
    assert all(int(p.view(torch.int16).count_nonzero()) == 0 for p in padding_rows(chunks))
    from nemo_dcr.runtimes.megatron.receiver import compare_slice_digests, held_coverage

    digests = rt.slice_digests()
    assert compare_slice_digests(want, digests) == [] and held_coverage(specs, digests) == {}


@pytest.mark.parametrize("op", [Op.XOR, Op.ADD, Op.OVERWRITE])
def test_apply_is_bit_exact_and_revert_restores(checkpoint, megatron, op):
    cfg, chunks, rt = build(checkpoint)
    before = export(chunks, cfg)
    old = flat_bits(before)
    new = perturb(old, seed=list(Op).index(op))
    records = records_for(rt.catalog(), old, new, op)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= {r.name for r in records}
    log = rt.apply(records)
    want = as_tensors(new, before)
    assert bit_mismatches(want, export(chunks, cfg)) == []
    assert bit_mismatches(want, rt.canonical_state()) == []
    assert all(int(p.view(torch.int16).count_nonzero()) == 0 for p in padding_rows(chunks))  # never written
    rt.revert(log)
    assert bit_mismatches(before, export(chunks, cfg)) == []


def test_stacked_applies_revert_newest_first(checkpoint, megatron):
    cfg, chunks, rt = build(checkpoint)
    v0 = flat_bits(export(chunks, cfg))
    v1 = perturb(v0, seed=10)
    v2 = perturb(v1, seed=11)
    log1 = rt.apply(records_for(rt.catalog(), v0, v1, Op.XOR))
    log2 = rt.apply(records_for(rt.catalog(), v1, v2, Op.OVERWRITE))
    assert flat_bits(export(chunks, cfg)).keys() == v2.keys()
    assert all(np.array_equal(flat_bits(export(chunks, cfg))[n], v2[n]) for n in v2)
    rt.revert(log2)
    assert all(np.array_equal(flat_bits(export(chunks, cfg))[n], v1[n]) for n in v1)
    rt.revert(log1)
    assert all(np.array_equal(flat_bits(export(chunks, cfg))[n], v0[n]) for n in v0)


def test_bad_records_fail_closed_without_writing(checkpoint, megatron):
    cfg, chunks, rt = build(checkpoint)
    before = export(chunks, cfg)
    dtype, shape = rt.catalog()[Q]
    good = Record(Q, dtype, shape, Op.XOR, np.array([1, 2], np.uint64), np.array([1, 1], np.uint16))
    unknown = Record("model.layers.9.self_attn.q_proj.weight", dtype, shape, Op.XOR, good.positions, good.values)
    with pytest.raises(ApplyError, match="not in the runtime's catalog"):
        rt.apply([good, unknown])
    assert bit_mismatches(before, export(chunks, cfg)) == []


def test_residual_qkv_takes_overwrites_and_refuses_deltas(checkpoint, megatron):
    """Fused QKV declared as a residual loads through its inverse (a transformed value):
    xor/add fail closed naming the reason, overwrites go through the verified dense
    overwrite (q rewritten, k and v read back from the model unchanged) and revert."""
    cfg, chunks, rt = build(checkpoint, qkv_as_residual=True)
    before = export(chunks, cfg)
    old = flat_bits(before)
    new = {n: v.copy() for n, v in old.items()}
    for name in (Q, "model.layers.1.self_attn.v_proj.weight"):
        new[name][::7] ^= np.uint16(0x0003)
    for op in (Op.XOR, Op.ADD):
        with pytest.raises(ApplyError, match=r"q_proj.*send an overwrite|transformed value"):
            rt.apply(records_for(rt.catalog(), old, new, op))
        assert bit_mismatches(before, export(chunks, cfg)) == []
    log = rt.apply(records_for(rt.catalog(), old, new, Op.OVERWRITE))
    assert bit_mismatches(as_tensors(new, before), export(chunks, cfg)) == []
    rt.revert(log)
    assert bit_mismatches(before, export(chunks, cfg)) == []


def test_subset_receiver_skips_tensors_it_does_not_hold(checkpoint, tmp_path):
    """A receiver whose runtime holds part of the model (`canonical_catalog=`): records of
    tensors it does not hold are validated and skipped, unknown names still rejected."""
    from nemo_dcr.receiver import Receiver
    from nemo_dcr.records import Payload, PayloadHeader
    from nemo_dcr.runtimes.store import TensorStoreRuntime
    from nemo_dcr.records import TransferInfo
    from nemo_dcr.transport import Event
    from nemo_dcr.wire import codec

    specs = read_specs(checkpoint)
    full = CheckpointReader(checkpoint).state_dict()
    held = {n: t.clone() for n, t in full.items() if ".layers.0." in n}
    info = TransferInfo("v0-v1-sub", 0, 1, ("p0",))
    transport = registry.transport("local", {"dir": str(tmp_path / "shm"), "timeout_s": 5}, receivers=["mx0"])
    coordinator, acks, end = transport.coordinator(), transport.producer("p0"), transport.receiver("mx0")

    def record(name):
        dtype, shape = specs.get(name, specs[Q])
        return Record(name, dtype, shape, Op.XOR, np.array([0, 3], np.uint64), np.array([1, 0x8000], np.uint16))

    def send(rx, pid, records):
        data = codec.encode(Payload(PayloadHeader(info.transfer_id, 0, 1, "p0", pid), records))
        rx.handle(Event("payload", {"transfer_id": info.transfer_id, "producer_id": "p0", "payload_id": pid}, data))
        rx.handle(Event("manifest", {"transfer_id": info.transfer_id, "producer_id": "p0", "payload_ids": [pid]}))
        return coordinator.collect("applied", info.transfer_id, 5)["mx0"]["error"]

    try:
        with pytest.raises(ValueError, match="canonical catalog"):
            Receiver("mx0", TensorStoreRuntime(held), end, canonical_catalog={Q: ("F16", specs[Q][1])})
        strict = Receiver("mx0", TensorStoreRuntime({n: t.clone() for n, t in held.items()}), end)
        strict.handle(Event("begin", {"transfer": info.to_json()}))
        assert "unknown tensor" in send(strict, "p0-0", [record("model.norm.weight")])  # the old behaviour

        rx = Receiver("mx0", TensorStoreRuntime(held), end, canonical_catalog=specs)
        rx.handle(Event("begin", {"transfer": info.to_json()}))
        error = send(rx, "p0-1", [record("model.norm.weight"), record(Q), record("model.layers.1.mlp.up_proj.weight")])
        assert error is None
        got = rx.runtime.canonical_state()
        assert got.keys() == held.keys()
        assert bit_mismatches({n: full[n] for n in held}, got) == [Q]  # the only held tensor recorded
        q = dtypes.bits_of(got[Q]).view(-1)
        q0 = dtypes.bits_of(full[Q]).view(-1)
        assert (q != q0).nonzero().view(-1).tolist() == [0, 3]

        rx.handle(Event("abort", {"transfer_id": info.transfer_id, "reason": "test"}))
        assert bit_mismatches({n: full[n] for n in held}, rx.runtime.canonical_state()) == []
        rx.handle(Event("begin", {"transfer": info.to_json()}))
        error = send(rx, "p0-2", [record("model.layers.9.mlp.up_proj.weight")])  # not in the checkpoint at all
        assert error and "unknown tensor" in error
    finally:
        end.close()
        acks.close()
        coordinator.close()
        transport.cleanup()


# -- multirank: a Megatron trainer refits a Megatron-inference job --------------------------

@pytest.mark.multirank
@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 90)
def test_megatron_trainer_refits_a_megatron_inference_job_with_another_layout(tmp_path):
    from nemo_dcr.cli import make_checkpoint

    steps = 3
    ckpt = make_checkpoint(tmp_path / "ckpt", family="qwen3", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128,
                           vocab=VOCAB, tied=True, seed=5)
    t = time.perf_counter()
    trainer_out, rx_log, receivers = trainer_refits_inference(
        tmp_path, ckpt, trainer_ranks=2, trainer_args=["--tp", "2", "--steps", str(steps), "--qkv-residual"],
        inference_tp=2, inference_pp=2, inference_args=["--qkv-residual-stages", "0"])
    print(f"trainer + inference jobs: {time.perf_counter() - t:.1f} s")
    assert trainer_out.count("whole-held digests match") == steps, trainer_out[-3000:]
    assert rx_log.count("fused QKV residual") == 2 and rx_log.count("fused QKV affine") == 2, rx_log[-3000:]
    check_exports(tmp_path, ckpt, receivers, steps)
