"""Producer(wire_version=...): the wire format its payloads are written in - 5, the host
format, by default (large records as one joint rANS stream), or 6, the device format, with
the changes of GPU-held ranges kept and coded on the device (device_coding; "always" runs
that torch path on CPU tensors here) - with the same records either way."""

import struct

import numpy as np
import pytest
import torch

from nemo_dcr.baseline import Baseline
from nemo_dcr.layout import LocalParam, OwnedRange
from nemo_dcr.placement import AffineMap, Piece
from nemo_dcr.sender import Producer
from nemo_dcr.records import TransferInfo
from nemo_dcr.wire import codec
from tests.support.transports import KeepingEnd

N = 200_000


# One piece (local = canonical), or two pieces of one canonical tensor in swapped halves
# (placement merges and sorts them), or a row-strided piece (a row-parallel shard).
PIECES = {"one": (Piece("c", 0, 1, N, 0, N),),
          "swapped": (Piece("c", 0, 1, N // 2, N // 2, N // 2), Piece("c", N // 2, 1, N // 2, 0, N // 2)),
          "strided": (Piece("c", 0, 400, N // 400, 0, 2 * N // 400),)}


def _payloads(pieces="one", readback=False, report=None, **kw) -> list[bytes]:
    """One 5% refit (+-1 ULP, and -1 ULP on a tenth of them) of a BF16 tensor of N
    elements (the same changes every call)."""
    t = (torch.randn(N, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    owned = [OwnedRange(LocalParam("w", (N,), torch.bfloat16), 0, N, t)]
    canon = 2 * N if pieces == "strided" else N
    maps = {"w": AffineMap("w", N, PIECES[pieces])}
    end = KeepingEnd()
    prod = Producer("p0", owned, maps, {"c": ("BF16", (canon,))}, Baseline(), end, **kw)
    bits = t.view(torch.int16)
    idx = torch.from_numpy(np.random.default_rng(1).choice(N, N // 20, replace=False))
    bits[idx] += 1
    bits[idx[::10]] -= 2
    rep = prod.refit(TransferInfo("t", 0, 1, ("p0",), readback=readback))
    if report is not None:
        report.append(rep)
    return end.payloads


def _same_records(a: list[bytes], b: list[bytes]) -> None:
    for x, y in zip(a, b, strict=True):
        ra, rb = codec.decode(x).records, codec.decode(y).records
        assert [(r.name, r.op) for r in ra] == [(r.name, r.op) for r in rb]
        for p, q in zip(ra, rb):
            np.testing.assert_array_equal(p.positions, q.positions)
            np.testing.assert_array_equal(p.values, q.values)


def test_payloads_are_v5_by_default():
    v5 = _payloads()
    assert [struct.unpack_from("<H", d, 4)[0] for d in v5] == [5] * len(v5)
    assert any('"gaps_joint"' in codec.header_text(d) for d in v5)
    _same_records(v5, _payloads(wire_version=6, device_coding="never"))  # v6 without the device path


@pytest.mark.parametrize("pieces", list(PIECES))
@pytest.mark.parametrize("op", ["xor", "add", "auto", "overwrite"])
def test_device_coding_gives_the_same_records(pieces, op):
    """wire_version 6 with the device path (here on CPU tensors): placed, gathered and
    coded by torch ops - the records of the host path, prefix-coded."""
    host, dev = _payloads(pieces, op=op), _payloads(pieces, op=op, wire_version=6, device_coding="always")
    assert [struct.unpack_from("<H", d, 4)[0] for d in dev] == [6] * len(dev)
    assert all('"gaps_prefix"' in codec.header_text(d) for d in dev)
    _same_records(host, dev)


def test_device_coding_digests_and_version_rules():
    reports = []
    host = _payloads(readback=True, report=reports, op="auto")
    dev = _payloads(readback=True, report=reports, op="auto", wire_version=6, device_coding="always")
    _same_records(host, dev)
    assert reports[0].readback == reports[1].readback  # the expected post-apply digests
    # CPU ranges take the compiled host path unless told otherwise; v5 never codes on a device.
    for kw in ({"wire_version": 6}, {"wire_version": 6, "device_coding": "never"},
               {"wire_version": 5, "device_coding": "always"}):
        assert not any('"gaps_prefix"' in codec.header_text(d) for d in _payloads(**kw))
    with pytest.raises(ValueError, match="device_coding must be 'gpu', 'always' or 'never', got 'cpu'"):
        _payloads(device_coding="cpu")


@pytest.mark.parametrize("bad", [3, 4, 7, "5", True, None])
def test_unknown_wire_version_is_refused(bad):
    with pytest.raises(ValueError, match=rf"wire_version must be 5 or 6 \(the formats payloads can be written in\), "
                                         rf"got {bad!r}"):
        _payloads(wire_version=bad)
