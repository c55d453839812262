"""Canonical positions from the diff itself: a 16-bit chunk that lies inside one piece, whose
block rows end on the diff's 128-element blocks, is diffed with a base and row skips
(`diff.Rows`) so that the scan writes the changes' canonical positions and no placement
pass follows; the baseline maps them back to the range's at the commit. The payloads and
the committed bits must be exactly those of the placement path."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from nemo_dcr import kernels
from nemo_dcr.baseline import Baseline
from nemo_dcr.diff import Rows, diff_arrays
from nemo_dcr.layout import LocalParam, OwnedRange
from nemo_dcr.placement import AffineMap, Piece
from nemo_dcr.records import Op, TransferInfo
from nemo_dcr.sender import AUTO, Producer
from tests.support.transports import KeepingEnd

BLOCK = kernels.diff.DIFF_BLOCK


def test_rows_position_and_index_are_inverse():
    rows = Rows(3 * BLOCK, 2 * BLOCK, 1000)
    idx = np.arange(20 * BLOCK)
    pos = rows.position(idx, base=77)
    assert np.all(np.diff(pos) > 0)
    assert pos[3 * BLOCK - 1] == 77 + 3 * BLOCK - 1 and pos[3 * BLOCK] == 77 + 3 * BLOCK + 1000  # the first row end
    assert pos[5 * BLOCK] == 77 + 5 * BLOCK + 2000
    assert [rows.position(int(i), 77) for i in idx[::97]] == pos[::97].tolist()
    np.testing.assert_array_equal(rows.index(pos, 77), idx)
    assert rows.fits_blocks() and not Rows(BLOCK + 1, BLOCK, 5).fits_blocks() and not Rows(0, 100, 5).fits_blocks()


@pytest.mark.parametrize("scan", ["vector", "bitscan"])
@pytest.mark.parametrize("narrow", [True, False])
@pytest.mark.parametrize("geometry", [(512, 1024, 0, 0), (256, 300, 7, 3), (128, 128 + 64, 5, 9), (1024, 1 << 31, 0, 2)])
def test_diff_with_rows_gives_the_pieces_canonical_positions(monkeypatch, scan, narrow, geometry):
    """Against the placement (Piece.canonical_index of the local positions), for chunks that
    start on a row or inside one, end past the last whole block (the tail), with int32 or
    int64 positions (the last geometry's canonical positions pass 2**31)."""
    if scan == "vector" and not kernels.diff.HAVE_VECTOR_DIFF:
        pytest.skip("no AVX-512 (VBMI2) diff on this host")
    monkeypatch.setattr(kernels.diff, "HAVE_VECTOR_DIFF", scan == "vector")
    cols, stride, offset, first_row = geometry
    n_rows = 24
    piece = Piece("c", 0, n_rows, cols, offset, stride)
    rng = np.random.default_rng(cols + first_row)
    old = rng.integers(0, 1 << 16, piece.size, dtype=np.uint16)
    new = old.copy()
    touched = np.flatnonzero(rng.random(piece.size) < 0.05)
    new[touched] ^= 1
    lo = first_row * cols + BLOCK  # inside a row, on a block
    hi = piece.size - 37  # a tail after the last whole block
    base, rows = piece.diff_rows(lo)
    pos, got_new, (xor,) = diff_arrays(new[lo:hi], old[lo:hi], ("xor",), base=base, narrow=narrow, rows=rows)
    local = lo + np.flatnonzero(new[lo:hi] != old[lo:hi])
    np.testing.assert_array_equal(pos.astype(np.int64), piece.canonical_index(local.astype(np.int64)))
    assert pos.dtype == (np.int32 if narrow and stride < 1 << 30 else np.int64)
    np.testing.assert_array_equal(got_new, new[local])
    np.testing.assert_array_equal(xor, new[local] ^ old[local])
    np.testing.assert_array_equal(rows.index(pos, base) + lo, local)


def test_rows_only_where_every_row_ends_on_a_block():
    strided = Piece("c", 0, 8, 512, 0, 1024)
    assert strided.diff_rows(BLOCK) == (BLOCK, Rows(512 - BLOCK, 512, 512))
    assert strided.diff_rows(512 + 3 * BLOCK) == (1024 + 3 * BLOCK, Rows(BLOCK, 512, 512))
    assert strided.diff_rows(64) is None  # a chunk starting mid-block
    assert Piece("c", 0, 8, 500, 0, 1000).diff_rows(0) is None  # rows of 500
    assert Piece("c", 10, 8, 512, 3, 512).diff_rows(10 + 700) == (703, None)  # contiguous: one shift
    amap = AffineMap("w", 2 * 4096, (Piece("a", 0, 8, 512, 0, 1024), Piece("b", 4096, 8, 512, 512, 1024)))
    assert amap.diff_placement(0, 4096) == ("a", 0, Rows(512, 512, 512))
    assert amap.diff_placement(4096 + 1024, 2 * 4096) == ("b", 512 + 2048, Rows(512, 512, 512))
    assert amap.diff_placement(2048, 4096 + 512) is None  # two pieces
    x = np.zeros(1024, np.uint16)
    with pytest.raises(ValueError, match="row ends on 128-element blocks"):
        diff_arrays(x, x, ("xor",), rows=Rows(100, 512, 512))  # a row end inside a block
    with pytest.raises(ValueError, match="need 16-bit arrays"):
        diff_arrays(x.view(np.uint8), x.view(np.uint8), ("xor",), rows=Rows(512, 512, 512))


ROWS, COLS = 48, 512


def _weights(seed: int):
    """Two row-parallel BF16 weights (TP rank 0 of 2: strided pieces) and a column-parallel
    one (contiguous), as (tensors, owned ranges, maps, specs)."""
    torch.manual_seed(seed)
    params, owned, maps, specs = [], [], {}, {}
    for i, strided in enumerate((True, True, False)):
        t = (torch.randn(ROWS, COLS) * 0.02).to(torch.bfloat16)
        owned.append(OwnedRange(LocalParam(f"w{i}", (ROWS, COLS), torch.bfloat16), 0, t.numel(), t.view(-1)))
        piece = Piece(f"c{i}", 0, ROWS, COLS, 0, 2 * COLS) if strided else Piece(f"c{i}", 0, ROWS, COLS, 3 * COLS, COLS)
        maps[f"w{i}"] = AffineMap(f"w{i}", t.numel(), (piece,))
        specs[f"c{i}"] = ("BF16", (ROWS, 2 * COLS) if strided else (2 * ROWS, COLS))
        params.append(t)
    return params, owned, maps, specs


def _refit(monkeypatch, tmp_path, op, chunk: int, canonical_diff: bool, readback: bool):
    """One refit of 5% +-1-ULP steps, then the commit of a file-backed baseline: (payloads,
    readback digests, the journal's positions per range, the committed bits per range)."""
    found = []  # what the producer's chunks got: (name, base, rows), or None (placed after the diff)
    real = AffineMap.diff_placement
    monkeypatch.setattr(AffineMap, "diff_placement",
                        lambda self, lo, hi: found.append(real(self, lo, hi) if canonical_diff else None) or found[-1])
    params, owned, maps, specs = _weights(0)
    baseline = Baseline(directory=tmp_path / f"bl-{canonical_diff}")
    for r in owned:
        baseline.register(r.key, r.tensor.view(torch.int16).clone())
    baseline.seal()
    rng = np.random.default_rng(1)
    for t in params:
        bits = t.view(-1).view(torch.int16)
        idx = torch.from_numpy(np.flatnonzero(rng.random(bits.numel()) < 0.05))
        bits[idx] += torch.from_numpy(rng.choice(np.array([1, -1], np.int16), idx.numel()))
    end = KeepingEnd()
    prod = Producer("p0", owned, maps, specs, baseline, end, op=op, max_payload_elements=1000, chunk_elements=chunk)
    rep = prod.refit(TransferInfo("t", 0, 1, ("p0",), readback=readback))
    baseline.persist_pending()
    journal_dir = tmp_path / f"bl-{canonical_diff}" / "journal"
    entries = json.loads((journal_dir / "journal.json").read_text())["entries"]
    journal = {e["key"]: np.load(journal_dir / f"{e['index']}.pos.npy").astype(np.int64).tolist() for e in entries}
    baseline.commit()
    baseline.wait_committed()
    committed = {r.key: baseline.committed(r.key).clone() for r in owned}
    for r in owned:
        assert torch.equal(committed[r.key], r.tensor.view(torch.int16)), r.key  # the baseline is the new state
    monkeypatch.undo()
    return end.payloads, rep.readback, journal, committed, found


@pytest.mark.parametrize("op", [Op.XOR, Op.ADD, AUTO, Op.OVERWRITE])
@pytest.mark.parametrize("chunk", [1 << 22, 5 * BLOCK, 1000])
def test_producer_sends_and_commits_what_the_placement_path_does(monkeypatch, tmp_path, op, chunk):
    """Chunks of one whole weight, of 5 blocks (starting inside rows, on blocks: canonical
    positions from the diff) and of 1000 elements (not on blocks: the placement path):
    byte for byte the same payloads, readback digests and journal, and a baseline equal to
    the weights after the commit."""
    for readback in (False, True):
        fused = _refit(monkeypatch, tmp_path / f"f{readback}", op, chunk, True, readback)
        placed = _refit(monkeypatch, tmp_path / f"p{readback}", op, chunk, False, readback)
        assert any(f is not None and f[2] is not None for f in fused[4])  # strided: rows from the diff
        assert any(f is not None and f[2] is None for f in fused[4])  # contiguous: a shift
        assert (None in fused[4]) == (chunk == 1000) and set(placed[4]) == {None}
        assert fused[0] == placed[0] and len(fused[0]) > 2
        assert fused[1] == placed[1]
        assert fused[2] == placed[2]
        assert all(torch.equal(fused[3][k], placed[3][k]) for k in placed[3])
