"""Producer(op="auto"): xor or add per record, whichever codes smaller - decided on an
even sample of the values when a record is large - and every record still bit-exact."""

import numpy as np
import pytest
import torch

from nemo_dcr import payload_builder, scan
from nemo_dcr.arena import Arena
from nemo_dcr.baseline import Baseline
from nemo_dcr.layout import LocalParam, OwnedRange
from nemo_dcr.placement import AffineMap, Piece
from nemo_dcr.records import Op, TransferInfo
from nemo_dcr.sender import AUTO, Producer
from nemo_dcr.wire import codec
from nemo_dcr.wire.values import choose_op
from tests.support.transports import KeepingEnd


def _refit(n: int, change) -> tuple[np.ndarray, np.ndarray, list]:
    """One op="auto" refit of two BF16 tensors of n elements where `change(bits, rng)`
    returns the new bits; (old bits, new bits, decoded records) of the whole thing."""
    rng = np.random.default_rng(0)
    params, owned, maps, specs = [], [], {}, {}
    for i in range(2):
        t = (torch.randn(n) * 0.02).to(torch.bfloat16)
        lp = LocalParam(f"w{i}", (n,), torch.bfloat16)
        owned.append(OwnedRange(lp, 0, n, t))
        maps[f"w{i}"] = AffineMap(f"w{i}", n, (Piece(f"c{i}", 0, 1, n, 0, n),))
        specs[f"c{i}"] = ("BF16", (n,))
        params.append(t)
    end = KeepingEnd()
    prod = Producer("p0", owned, maps, specs, Baseline(), end, op=AUTO, chunk_elements=n // 3)
    old = [t.view(torch.int16).numpy().view(np.uint16).copy() for t in params]
    new = [change(o.copy(), rng) for o in old]
    for t, b in zip(params, new):
        t.view(torch.int16).copy_(torch.from_numpy(b.view(np.int16)))
    prod.refit(TransferInfo("t", 0, 1, ("p0",)))
    records = [r for data in end.payloads for r in codec.decode(data).records]
    return old, new, records


def _apply(old: list[np.ndarray], records: list) -> list[np.ndarray]:
    out = [o.copy() for o in old]
    for r in records:
        flat = out[int(r.name[1:])]
        pos = r.positions.astype(np.int64)
        flat[pos] = flat[pos] ^ r.values if Op(r.op) is Op.XOR else flat[pos] + r.values
    return out


def _one_ulp(bits, rng):
    idx = rng.choice(bits.size, bits.size // 20, replace=False)
    bits[idx] += rng.choice(np.array([1, 0xFFFF], np.uint16), idx.size)  # +-1 ULP, wrapping
    return bits


def _one_bit(bits, rng):
    idx = rng.choice(bits.size, bits.size // 20, replace=False)
    bits[idx] ^= (np.uint16(1) << rng.integers(0, 7, idx.size).astype(np.uint16))
    return bits


@pytest.mark.parametrize("compiled_diff", [True, False], ids=["compiled-diff", "torch-diff"])
def test_auto_picks_add_for_ulp_steps_and_xor_for_bit_flips_on_a_sample(monkeypatch, compiled_diff):
    # The diff keeps the add values and the new bits; xor records are computed from them.
    if not compiled_diff:  # the torch ops a GPU producer runs, here on the host
        monkeypatch.setattr(scan, "_compiled_diff", lambda current, committed: False)
    n = 3 * payload_builder.CHOICE_SAMPLE * 20  # each record holds ~3x the sample: the choice is sampled
    for change, want in ((_one_ulp, Op.ADD), (_one_bit, Op.XOR)):
        old, new, records = _refit(n, change)
        assert records and {Op(r.op) for r in records} == {want}
        assert max(r.positions.size for r in records) > 2 * payload_builder.CHOICE_SAMPLE
        for got, exp in zip(_apply(old, records), new):
            np.testing.assert_array_equal(got, exp)


def test_sampled_choice_matches_the_exact_one_on_small_records():
    rng = np.random.default_rng(1)
    old = rng.integers(0, 1 << 16, 1000, dtype=np.uint16)
    ulp = old + rng.choice(np.array([1, 0xFFFF], np.uint16), 1000)  # add: 2 values, xor: many
    flip = old ^ rng.choice(np.array([1, 2, 4], np.uint16), 1000)  # xor: 3 values, add: more
    for new, want in ((ulp, Op.ADD), (flip, Op.XOR)):
        add = new - old
        pairs = [(add[:400], new[:400]), (add[400:], new[400:])]  # (add, new bits), as the producer keeps them
        assert choose_op(new ^ old, add, 2) is want
        assert payload_builder.choose_op_sampled(pairs) is want


def test_xor_of_add_and_new_bits():
    rng = np.random.default_rng(2)
    old = rng.integers(0, 1 << 16, 3000, dtype=np.uint16)
    new = rng.integers(0, 1 << 16, 3000, dtype=np.uint16)
    add = new - old
    pairs = [(add[:1000], new[:1000]), (add[1000:1001], new[1000:1001]), (add[1001:], new[1001:])]
    arena = Arena().reset(1 << 10)  # smaller than needed: the arena grows
    np.testing.assert_array_equal(payload_builder.xor_of(pairs, arena), new ^ old)
