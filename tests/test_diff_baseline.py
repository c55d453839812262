"""Diff and baseline: bit-level semantics, commit / abort, file-backed storage."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.baseline import Baseline
from nemo_dcr.diff import diff


def bits(values, dtype=torch.bfloat16):
    return torch.tensor(values, dtype=dtype).view(torch.int16)


def test_diff_compares_stored_bits_not_values():
    old = bits([0.0, 1.0, float("nan"), 2.0, -0.0])
    new = bits([-0.0, 1.0, float("nan"), 2.015625, -0.0])  # 2.015625 = 2.0 + 1 ULP
    d = diff(new, old)
    assert d.positions.tolist() == [0, 3]  # -0.0 != 0.0 by bits; NaN == NaN by bits
    assert (d.xor() ^ d.old).tolist() == d.new.tolist()
    assert ((d.old + d.add()).tolist()) == d.new.tolist()


def test_add_wraps_mod_2_16():
    old = torch.tensor([32767, -32768, 0], dtype=torch.int16)
    new = torch.tensor([-32768, 32767, -1], dtype=torch.int16)
    d = diff(new, old)
    assert (d.old + d.add()).tolist() == new.tolist()
    assert d.add().numpy().view(np.uint16).tolist() == [1, 65535, 65535]


def test_diff_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="equal shapes"):
        diff(torch.zeros(3, dtype=torch.int16), torch.zeros(4, dtype=torch.int16))


@pytest.mark.parametrize("file_backed", [False, True])
def test_baseline_commit_and_abort(tmp_path, file_backed):
    b = Baseline(directory=tmp_path / "bl" if file_backed else None)
    start = torch.arange(10, dtype=torch.int16)
    b.register("w[0:10]", start)
    start[0] = 99  # the baseline holds a copy, not a view
    assert b.committed("w[0:10]")[0].item() == 0
    b.begin(1)
    b.stage("w[0:10]", torch.tensor([2, 5]), torch.tensor([-1, -2], dtype=torch.int16))
    b.abort()
    assert b.version == 0 and b.committed("w[0:10]").tolist() == list(range(10))
    b.begin(1)
    b.stage("w[0:10]", torch.tensor([2, 5]), torch.tensor([-1, -2], dtype=torch.int16))
    b.stage("w[0:10]", torch.tensor([7]), torch.tensor([-3], dtype=torch.int16))
    assert b.commit() == 1
    assert b.committed("w[0:10]").tolist() == [0, 1, -1, 3, 4, -2, 6, -3, 8, 9]
    with pytest.raises(ValueError, match="version 1 cannot start a transfer to 3"):
        b.begin(3)
    if file_backed:
        assert sorted(f.suffix for f in (tmp_path / "bl").iterdir()) == [".bits", ".json"]  # the range, the manifest


def test_baseline_rejects_double_registration():
    b = Baseline()
    b.register("k", torch.zeros(2, dtype=torch.int16))
    with pytest.raises(ValueError, match="registered twice"):
        b.register("k", torch.zeros(2, dtype=torch.int16))


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.uint8, torch.int8])
@pytest.mark.parametrize("n", [64, 67, 1000, 12_345])
@pytest.mark.parametrize("rate", [0.0, 0.01, 0.5, 1.0])
def test_word_diff_matches_elementwise(dtype, n, rate):
    """The CPU word-compare path gives exactly ne().nonzero(), for any length and offset."""
    rng = np.random.default_rng(n)
    old = torch.from_numpy(rng.integers(0, 100, n + 3)).to(dtype)
    new = old.clone()
    mask = torch.from_numpy(rng.random(n + 3) < rate)
    new[mask] += 1
    for lo in (0, 3):  # a slice that does not start on a word boundary
        a, b = new[lo:lo + n], old[lo:lo + n]
        d = diff(a, b)
        ref = torch.ne(a, b).nonzero().view(-1)
        assert torch.equal(d.positions, ref) and d.positions.dtype == torch.int64
        assert torch.equal(d.new, a[ref]) and torch.equal(d.old, b[ref])
