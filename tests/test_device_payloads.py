"""Device payloads: frames sealed where the producer's weights live (`codec.encode(on_device=)`,
`Producer(device_payloads=True)`), checked by the device checksum (flag bit 2) instead of
XXH3. On CPU tensors here (the same torch code a GPU runs); the CUDA IPC hand-over itself
is tests/test_local_cuda_ipc.py's, on a GPU."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from nemo_dcr.baseline import Baseline
from nemo_dcr.history import DELTAS, DirectoryHistory
from nemo_dcr.layout import LocalParam, OwnedRange
from nemo_dcr.placement import AffineMap, Piece
from nemo_dcr.records import Op, Payload, TransferInfo
from nemo_dcr.sender import Producer
from nemo_dcr.verify import bit_mismatches
from nemo_dcr.wire import codec
from nemo_dcr.wire.frame import CHECKSUM_BYTES, DEVICE_CHECKSUM_PRIME, FLAG_DEVICE_CHECKSUM, FLAG_HMAC, \
    device_checksum
from tests.support.transports import KeepingEnd
from tests.support.wait import serving
from tests.test_codec import HDR, assert_same, encodings, payload, reject, ulp_record
from tests.test_local_refit import Setup, checkpoint  # noqa: F401  (a fixture)
from tests.test_prefix_codec import as_tensors

PREFIX = ("gaps_prefix", "symbols_prefix")


def reference_checksum(data: bytes) -> bytes:
    """The device checksum as docs/wire-format.md defines it, in Python integers."""
    p = DEVICE_CHECKSUM_PRIME
    padded = data + b"\0" * (len(data) % 2)
    words = struct.unpack(f"<{len(padded) // 2}H", padded)
    sums = [sum(w * pow(i, k, p) for i, w in enumerate(words, start=1)) % p for k in range(4)]
    return struct.pack("<4I", *sums)


@pytest.mark.parametrize("size", [1, 2, 3, 1000, 4097])
def test_device_checksum_is_the_documented_sums(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert device_checksum(torch.frombuffer(bytearray(data), dtype=torch.uint8)) == reference_checksum(data)


def test_device_checksum_sees_every_flipped_byte_and_swapped_word():
    data = bytearray(np.random.default_rng(0).integers(0, 256, 301, dtype=np.uint8).tobytes())
    want = device_checksum(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    for at in range(len(data)):
        for flip in (1, 0x80, 0xFF):
            bad = bytearray(data)
            bad[at] ^= flip
            assert device_checksum(torch.frombuffer(bad, dtype=torch.uint8)) != want, (at, flip)
    swapped = bytearray(data)
    swapped[10:12], swapped[40:42] = data[40:42], data[10:12]
    assert data[10:12] != data[40:42]
    assert device_checksum(torch.frombuffer(swapped, dtype=torch.uint8)) != want


def records():
    return [ulp_record("w", 300_000, 0.03), ulp_record("v", 300_000, 0.05, op=Op.ADD, seed=1),
            ulp_record("small", 1000, 0.02, seed=2)]  # too few changes to prefix-code: host-coded


def test_a_frame_sealed_on_a_device_is_the_host_frame_but_for_flag_and_trailer():
    recs = records()
    tensors = Payload(HDR, [as_tensors(r) for r in recs])
    host = codec.encode(tensors, version=6)
    frame = codec.encode(tensors, version=6, on_device="cpu")
    assert isinstance(frame, torch.Tensor) and frame.dtype == torch.uint8 and frame.dim() == 1
    data = frame.numpy().tobytes()
    assert len(data) == len(host) and data[:6] == host[:6] and data[8:-CHECKSUM_BYTES] == host[8:-CHECKSUM_BYTES]
    flags = struct.unpack_from("<H", data, 6)[0]
    assert flags == struct.unpack_from("<H", host, 6)[0] | FLAG_DEVICE_CHECKSUM
    assert data[-CHECKSUM_BYTES:] == reference_checksum(data[:-CHECKSUM_BYTES])
    assert encodings(data)[:2] == [PREFIX, PREFIX]
    assert_same(payload(*recs), codec.decode(data))


def test_a_device_frame_that_was_changed_or_is_not_allowed_is_rejected():
    data = bytearray(codec.encode(Payload(HDR, [as_tensors(r) for r in records()]), version=6,
                                  on_device="cpu").numpy().tobytes())
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 4
    reject(bytes(bad), "checksum mismatch (device checksum)")
    v5 = bytearray(data)
    v5[4:6] = struct.pack("<H", 5)
    reject(bytes(v5), "flag bit 2 (device checksum) is only valid in format 6")
    signed = bytearray(data)
    signed[6:8] = struct.pack("<H", struct.unpack_from("<H", data, 6)[0] | FLAG_HMAC)
    reject(bytes(signed), "never with an HMAC")
    reject(bytes(data), "HMAC missing", key=b"k")  # a receiver that holds a key takes signed payloads only


@pytest.mark.parametrize("kw, why", [(dict(version=5), "on_device needs version 6"),
                                     (dict(version=6, key=b"k"), "and a key")])
def test_encode_refuses_a_device_frame_it_cannot_seal(kw, why):
    with pytest.raises(ValueError, match=why):
        codec.encode(payload(*records()), on_device="cpu", **kw)


class DeviceEnd(KeepingEnd):
    """Keeps what it is sent, as a transport that carries device tensors would get it."""

    carries_device_tensors = True


def one_tensor_producer(t: torch.Tensor, end, **kw) -> Producer:
    n = t.numel()
    owned = [OwnedRange(LocalParam("w", (n,), t.dtype), 0, n, t)]
    maps = {"w": AffineMap("w", n, (Piece("c", 0, 1, n, 0, n),))}
    return Producer("p0", owned, maps, {"c": ("BF16", (n,))}, Baseline(), end, **kw)


@pytest.mark.parametrize("kw, why", [
    (dict(wire_version=5), "device_payloads needs wire_version 6"),
    (dict(wire_version=6, key=b"k"), "device_payloads cannot be signed"),
    (dict(wire_version=6, end=KeepingEnd()), "needs a transport that carries device tensors"),
])
def test_producer_refuses_device_payloads_it_cannot_send(kw, why):
    end = kw.pop("end", DeviceEnd())
    with pytest.raises(ValueError, match=why):
        one_tensor_producer(torch.zeros(100, dtype=torch.bfloat16), end, device_payloads=True, **kw)


def test_producer_device_payloads_carry_the_device_coded_streams_and_rebuild_the_new_bits():
    n = 1_000_000
    rng = np.random.default_rng(3)
    w = (torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    held = w.view(torch.int16).numpy().view(np.uint16).copy()  # what a receiver holds
    end = DeviceEnd()
    prod = one_tensor_producer(w, end, wire_version=6, device_coding="always", device_payloads=True,
                               max_payload_elements=8000, chunk_elements=n // 4)
    pos = np.flatnonzero(rng.random(n) < 0.03)
    w.view(torch.int16)[torch.from_numpy(pos)] += 1
    prod.refit(TransferInfo("t0", 0, 1, ("p0",)))
    assert len(end.payloads) > 1
    for data in end.payloads:
        assert struct.unpack_from("<H", data, 6)[0] & FLAG_DEVICE_CHECKSUM
        for r in codec.decode(data).records:
            p = r.positions.astype(np.int64)
            held[p] = held[p] ^ r.values if Op(r.op) is Op.XOR else held[p] + r.values  # xor or add: AUTO
    assert any(PREFIX in encodings(d) for d in end.payloads)
    assert np.array_equal(held, w.view(torch.int16).numpy().view(np.uint16))


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_a_refit_with_device_payloads_over_the_local_transport_is_bit_exact(checkpoint, tmp_path, device):  # noqa: F811
    """Receivers verify the device checksum; the stored deltas (for catch-up) are the frames
    sent. cuda: the receivers are threads of the trainer's process, handed its tensors (CUDA
    IPC cannot map memory into the process that owns it)."""
    s = Setup(checkpoint, tmp_path, device=device, refit_kw=dict(wire_version=6, device_payloads=True,
                                                                 history=str(tmp_path / "history")))
    try:
        for version in (1, 2):
            s.step()
            result = s.refit.refit()
            assert result.decision.committed and result.decision.version == version
            serving(s.receivers, version)
            for r in s.receivers:
                assert bit_mismatches(s.expected(), r.runtime.canonical_state()) == []
        history = DirectoryHistory(tmp_path / "history")
        stored = history.manifest(DELTAS, 2, None)
        assert stored
        for pid in stored:
            data = history.get_payload(DELTAS, 2, pid)
            assert struct.unpack_from("<H", data, 6)[0] & FLAG_DEVICE_CHECKSUM
            codec.decode(data)  # the device checksum holds on what was stored
    finally:
        s.close()
