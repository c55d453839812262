"""Producer(wire_version=...): the wire format its payloads are written in - 5 by default
(large records as one joint rANS stream), 4 for receivers that read only version 4 - with
the same records either way."""

import struct

import numpy as np
import pytest
import torch

from nemo_dcr import codec
from nemo_dcr.baseline import Baseline
from nemo_dcr.layout import LocalParam, OwnedRange
from nemo_dcr.placement import AffineMap, Piece
from nemo_dcr.sender import Producer
from nemo_dcr.transport import TransferInfo
from tests.support.transports import KeepingEnd

N = 200_000


def _payloads(**kw) -> list[bytes]:
    """One 5% +-1-ULP refit of a BF16 tensor of N elements (the same changes every call)."""
    t = (torch.randn(N, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    owned = [OwnedRange(LocalParam("w", (N,), torch.bfloat16), 0, N, t)]
    maps = {"w": AffineMap("w", N, (Piece("c", 0, 1, N, 0, N),))}
    end = KeepingEnd()
    prod = Producer("p0", owned, maps, {"c": ("BF16", (N,))}, Baseline(), end, **kw)
    bits = t.view(torch.int16)
    idx = torch.from_numpy(np.random.default_rng(1).choice(N, N // 20, replace=False))
    bits[idx] += 1
    prod.refit(TransferInfo("t", 0, 1, ("p0",)))
    return end.payloads


def test_payloads_are_v5_by_default_and_v4_on_request():
    v5, v4 = _payloads(), _payloads(wire_version=4)
    assert [struct.unpack_from("<H", d, 4)[0] for d in v5 + v4] == [5] * len(v5) + [4] * len(v4)
    assert any(b'"gaps_joint"' in d for d in v5) and not any(b'"gaps_joint"' in d for d in v4)
    for a, b in zip(v5, v4, strict=True):
        ra, rb = codec.decode(a).records, codec.decode(b).records
        assert [(r.name, r.op) for r in ra] == [(r.name, r.op) for r in rb]
        for x, y in zip(ra, rb):
            np.testing.assert_array_equal(x.positions, y.positions)
            np.testing.assert_array_equal(x.values, y.values)


@pytest.mark.parametrize("bad", [3, 7, "5", True, None])
def test_unknown_wire_version_is_refused(bad):
    with pytest.raises(ValueError, match=rf"wire_version must be 4, 5 or 6 \(the formats payloads can be written in\), "
                                         rf"got {bad!r}"):
        _payloads(wire_version=bad)
