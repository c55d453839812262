"""Bad payloads reach a real receiver (HF model, local transport end): each is
rejected before any byte is written, the transfer fails with a named reason, and
the receiver's bits and serving version stay at the base."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from nemo_dcr import registry
from nemo_dcr.receiver import Receiver
from nemo_dcr.records import Op, Payload, PayloadHeader, Record, TransferInfo
from nemo_dcr.runtimes.hf import HFRuntime
from nemo_dcr.transport import Event
from nemo_dcr.verify import bit_mismatches
from nemo_dcr.wire import codec

INFO = TransferInfo("v0-v1-test", 0, 1, ("p0",))
NAME, SHAPE = "model.layers.0.mlp.down_proj.weight", (64, 128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    return path


def payload(records, **header):
    h = dict(transfer_id=INFO.transfer_id, base_version=0, target_version=1, producer_id="p0", payload_id="p0-0")
    h.update(header)
    return codec.encode(Payload(PayloadHeader(**h), records))


def good_record(name=NAME, shape=SHAPE, positions=(1, 5, 9), dtype="BF16"):
    pos = np.array(positions, np.uint64)
    return Record(name, dtype, shape, Op.XOR, pos, np.full(len(pos), 0x0101, np.uint16))


def out_of_range() -> bytes:
    """A sealed payload whose positions run past the tensor (the encoder refuses to
    make one, so the section is rewritten and the payload resealed)."""
    from tests.test_codec import rejoin, set_section, split, varints

    _, header, secs = split(payload([good_record(positions=(1, 2))]))
    set_section(header, secs, 0, "positions", varints(1, 1, 64 * 128 - 2, 1))  # positions 1 and 8192
    return rejoin(header, secs)


def corrupt(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 2] ^= 0xFF
    return bytes(b)


CASES = {
    "corrupted": (lambda: corrupt(payload([good_record()])), "checksum"),
    "truncated": (lambda: payload([good_record()])[:-20], "truncated|checksum|length|size"),
    "wrong version": (lambda: payload([good_record()], base_version=3, target_version=4), "version"),
    "unknown tensor": (lambda: payload([good_record(name="model.layers.9.mlp.down_proj.weight")]), "unknown tensor"),
    "out of range": (out_of_range, ">= numel 8192"),
    "shape mismatch": (lambda: payload([good_record(shape=(128, 64))]), "shape"),
    "dtype mismatch": (lambda: payload([Record(NAME, "F16", SHAPE, Op.XOR, np.array([1], np.uint64),
                                               np.array([1], np.uint16))]), "dtype"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_payload_is_rejected_before_any_write(checkpoint, tmp_path, case):
    make, reason = CASES[case]
    transport = registry.transport("local", {"dir": str(tmp_path / "shm"), "timeout_s": 5}, receivers=["rx0"])
    coordinator = transport.coordinator()
    producer_acks = transport.producer("p0")  # receives the receiver's 'staged' answers
    end = transport.receiver("rx0")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    rx = Receiver("rx0", HFRuntime(model, checkpoint_dir=checkpoint), end)
    before = {k: v.clone() for k, v in rx.runtime.canonical_state().items()}
    try:
        rx.handle(Event("begin", {"transfer": INFO.to_json()}))
        rx.handle(Event("payload", {"transfer_id": INFO.transfer_id, "producer_id": "p0", "payload_id": "p0-0"},
                        make()))
        rx.handle(Event("manifest", {"transfer_id": INFO.transfer_id, "producer_id": "p0", "payload_ids": ["p0-0"]}))
        applied = coordinator.collect("applied", INFO.transfer_id, 5)["rx0"]
        assert applied["error"] and "p0-0" in applied["error"]
        assert any(word in applied["error"] for word in reason.split("|")), applied["error"]
        assert rx.serving_version == 0
        assert bit_mismatches(before, rx.runtime.canonical_state()) == []
    finally:
        end.close()
        producer_acks.close()
        coordinator.close()
        transport.cleanup()


def test_duplicate_delivery_is_applied_once(checkpoint, tmp_path):
    transport = registry.transport("local", {"dir": str(tmp_path / "shm"), "timeout_s": 5}, receivers=["rx0"])
    coordinator, producer_acks, end = transport.coordinator(), transport.producer("p0"), transport.receiver("rx0")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    rx = Receiver("rx0", HFRuntime(model, checkpoint_dir=checkpoint), end)
    before = rx.runtime.canonical_state()[NAME].clone()
    try:
        data = payload([good_record()])
        meta = {"transfer_id": INFO.transfer_id, "producer_id": "p0", "payload_id": "p0-0"}
        rx.handle(Event("begin", {"transfer": INFO.to_json()}))
        rx.handle(Event("payload", dict(meta), data))
        rx.handle(Event("payload", dict(meta), data))  # at-least-once delivery: a replay
        rx.handle(Event("manifest", {**meta, "payload_ids": ["p0-0"]}))
        assert coordinator.collect("applied", INFO.transfer_id, 5)["rx0"]["error"] is None
        rx.handle(Event("commit", {"transfer_id": INFO.transfer_id}))
        after = rx.runtime.canonical_state()[NAME].view(-1).view(torch.int16)
        changed = (after != before.view(-1).view(torch.int16)).nonzero().view(-1).tolist()
        assert changed == [1, 5, 9] and rx.serving_version == 1  # xor applied once, not twice
    finally:
        end.close()
        producer_acks.close()
        coordinator.close()
        transport.cleanup()
