"""One-process refits over the real local transport (shared memory + ZeroMQ) into a
real Hugging Face receiver: the plain-PyTorch capture, identity placement, codec,
receiver, joint commit and failure handling, without Megatron."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from nemo_dcr import registry
from nemo_dcr.capture import torch_owned_ranges
from nemo_dcr.checkpoint import read_specs
from nemo_dcr.errors import TransferFailed
from nemo_dcr.layout import ParallelLayout
from nemo_dcr.receiver import Receiver
from nemo_dcr.records import Op
from nemo_dcr.runtimes.hf import HFRuntime
from nemo_dcr.trainer import TrainerRefit
from nemo_dcr.verify import bit_mismatches
from tests.support.transports import open_transport
from tests.support.wait import serving


def tiny_checkpoint(path, seed: int = 0):
    """A tiny Llama (tied embeddings, BF16) saved at `path`, its weights drawn from `seed`."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


pytestmark = pytest.mark.usefixtures("single_rank_group")


class Setup:
    """A trainer (HF model + AdamW in BF16) and receivers on threads, over the local transport."""

    def __init__(self, checkpoint, tmp_path, n_receivers=2, op=Op.XOR, key=None, receiver_key=None,
                 timeout_s=20, runtime_wrapper=None, max_attempts=3, refit_kw=None, receiver_kw=None, device="cpu",
                 receiver_checkpoints=None, trainer_setup=None, transport="local"):
        """`runtime_wrapper(receiver_id, runtime)`: what the receiver applies through
        (fault injection); `max_attempts`: the trainer's tries per transfer; `device`: where
        the trainer's and the receivers' models live; `receiver_checkpoints`: receiver id ->
        the checkpoint its model is loaded from (default: the trainer's); `trainer_setup(model)`:
        called on the trainer's model before its optimizer is made; `transport`: local, or
        relay / s3 on real parts (tests/support/transports.py)."""
        self.device = device
        self.ids = [f"rx{i}" for i in range(n_receivers)]
        self.transport = open_transport(transport, tmp_path, self.ids, timeout_s=timeout_s)
        self.receivers, self.threads = [], []
        wrap = runtime_wrapper or (lambda rx, runtime: runtime)
        for rx in self.ids:
            model = AutoModelForCausalLM.from_pretrained((receiver_checkpoints or {}).get(rx, checkpoint),
                                                         dtype=torch.bfloat16).to(device)
            r = Receiver(rx, wrap(rx, HFRuntime(model, checkpoint_dir=checkpoint)), self.transport.receiver(rx),
                         key=receiver_key if receiver_key is not None else key, **(receiver_kw or {}))
            self.receivers.append(r)
            t = threading.Thread(target=r.serve_forever, args=(0.05,), daemon=True)
            t.start()
            self.threads.append(t)
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(device)
        if trainer_setup is not None:
            trainer_setup(self.model)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-3)
        self.refit = TrainerRefit(registry.converter("identity", self.model.config), read_specs(checkpoint),
                                  torch_owned_ranges(self.model), ParallelLayout(), self.transport,
                                  state_dir=str(tmp_path / "state"), op=op, key=key,
                                  max_payload_elements=500, timeout_s=timeout_s, max_attempts=max_attempts,
                                  **(refit_kw or {}))

    def step(self):
        ids = torch.randint(0, 300, (2, 16), device=self.device)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def expected(self):
        return {k: v for k, v in self.model.state_dict().items() if k != "lm_head.weight"}

    def close(self):
        self.refit.close(shutdown_receivers=True)
        for t in self.threads:
            t.join(timeout=10)
        for r, t in zip(self.receivers, self.threads):  # one that ignored the shutdown (another key)
            r.stop()
            t.join(timeout=10)
        for r in self.receivers:
            r.end.close()
        self.transport.cleanup()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("op", [Op.XOR, Op.ADD, Op.OVERWRITE])
def test_refits_are_bit_exact_and_commit_jointly(checkpoint, tmp_path, op, device):
    # cuda: the trainer diffs on the GPU against its device mirror, receivers apply on the GPU
    s = Setup(checkpoint, tmp_path, op=op, device=device)
    try:
        for version in (1, 2, 3):
            s.step()
            result = s.refit.refit()
            assert result.decision.committed and result.decision.version == version
            assert s.refit.baseline.version == version
            assert 0 < result.changed_elements < result.scanned_elements
            m = result.metrics()
            assert m["payloads"] > 1  # streamed in several payloads
            # every stage a logger expects, timed (capture is part of diff: the ranges are live views)
            for stage in ("diff", "place", "encode", "transfer"):
                assert m[f"producer_{stage}_s"] > 0, stage
            for phase in ("prepare", "wait_applied", "commit"):
                assert m[f"coordinator_{phase}_s"] > 0, phase
            assert m["pause_s"] == m["receiver_apply_s"] > 0 and m["receiver_stage_s"] > 0
            assert m["receivers"] == len(s.receivers)
            assert all(type(m[k]) is int and m[k] >= 0 for k in ("producer_page_faults", "receiver_page_faults"))
            # the refit thread's CPU time: some, and no more than the refit took (one thread)
            assert 0 < m["producer_cpu_s"] <= m["refit_s"]
            assert m["receiver_cpu_s"] > 0  # the receivers' process (here the test's own) decoded and applied
            serving(s.receivers, version)  # the commit message reaches receiver threads after refit() returns
            for r in s.receivers:
                assert bit_mismatches(s.expected(), r.runtime.canonical_state()) == []
        assert (tmp_path / "state" / "commits" / "v00000003.json").exists()
    finally:
        s.close()


def test_empty_transfer_commits(checkpoint, tmp_path):
    s = Setup(checkpoint, tmp_path, n_receivers=1)
    try:
        result = s.refit.refit()  # no step: nothing changed
        assert result.decision.committed and result.changed_elements == 0
        assert bit_mismatches(s.expected(), s.receivers[0].runtime.canonical_state()) == []
    finally:
        s.close()


def test_rejected_payload_aborts_and_leaves_everything_at_base(checkpoint, tmp_path):
    """A receiver with the wrong HMAC key rejects the transfer (its begin, and any payload): it fails,
    no receiver bit changes, and the producers' baselines stay at version 0."""
    s = Setup(checkpoint, tmp_path, key=b"trainer-key", receiver_key=b"other-key")
    before = [{k: v.clone() for k, v in r.runtime.canonical_state().items()} for r in s.receivers]
    baseline_before = {k: s.refit.baseline.committed(k).clone() for k in s.refit.baseline.keys()}
    try:
        s.step()
        with pytest.raises(TransferFailed, match="MAC"):
            s.refit.refit()
        assert s.refit.baseline.version == 0 and not s.refit.baseline.in_flight
        for k, v in baseline_before.items():
            assert torch.equal(s.refit.baseline.committed(k), v)
        for r, old in zip(s.receivers, before):
            assert r.serving_version == 0
            assert bit_mismatches(old, r.runtime.canonical_state()) == []
    finally:
        s.close()


def test_failed_transfer_is_resent_against_the_committed_baseline(checkpoint, tmp_path):
    """After an aborted transfer the next delta is taken against version v (not the
    pre-step bits), so receivers still end bit-exact."""
    s = Setup(checkpoint, tmp_path, n_receivers=1, max_attempts=1)
    try:
        s.step()
        limit, s.receivers[0].max_staged_bytes = s.receivers[0].max_staged_bytes, 1  # every payload is refused
        with pytest.raises(TransferFailed, match="max_staged_bytes"):
            s.refit.refit()
        with pytest.raises(TransferFailed, match="max_staged_bytes"):
            s.refit.refit()
        s.receivers[0].max_staged_bytes = limit
        s.step()
        result = s.refit.refit()
        assert result.decision.committed and result.decision.version == 1
        assert result.metrics()["failed_transfers_before"] == 2 and result.metrics()["recovered"] is True
        assert result.metrics()["retries"] == 0  # the refit that committed needed one attempt
        assert s.refit.refit().metrics()["failed_transfers_before"] == 0  # counted once, by the commit that ended them
        assert bit_mismatches(s.expected(), s.receivers[0].runtime.canonical_state()) == []
    finally:
        s.close()


def test_first_payload_leaves_before_the_last_range_is_diffed(checkpoint, tmp_path):
    s = Setup(checkpoint, tmp_path, n_receivers=1)
    events = []
    real_send, real_stage = s.refit.producer.end.send, s.refit.baseline.stage
    s.refit.producer.end.send = lambda *a: (events.append("send"), real_send(*a))
    s.refit.baseline.stage = lambda *a, **k: (events.append("diff"), real_stage(*a, **k))
    try:
        s.step()
        assert s.refit.refit().decision.committed
        assert events.index("send") < len(events) - 1 - events[::-1].index("diff")
        assert events.count("send") > 2
    finally:
        s.close()
