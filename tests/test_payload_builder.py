"""The producer's payload builder: records are the concatenation of the queued parts, and
the concatenations reuse one arena from payload to payload (no fresh pages per payload)."""

from __future__ import annotations

import numpy as np

from nemo_dcr.arena import Arena
from nemo_dcr.payload_builder import PayloadBuilder
from nemo_dcr.records import Op

SPECS = {"a": ("BF16", (1000,)), "b": ("F32", (1000,))}


def _queue(builder, rng, n_parts=3):
    expected = {}
    for name, dt in (("a", np.uint16), ("b", np.uint32)):
        cuts = np.sort(rng.choice(1000, 2 * n_parts, replace=False)).reshape(n_parts, 2)
        # Parts of uint32 positions (int32 from the diff, placed as they are) and of uint64 ones.
        pos = [np.arange(lo, hi, dtype=rng.choice([np.uint32, np.uint64])) for lo, hi in cuts]
        vals = [rng.integers(1, 2**16, p.size).astype(dt) for p in pos]
        for p, v in zip(pos, vals):
            builder.add(name, Op.XOR, p, v, increasing=True)
        wide = any(p.dtype == np.uint64 for p in pos)  # uint32 positions stay so when every part is
        expected[name] = (np.concatenate(pos).astype(np.uint64 if wide else np.uint32), np.concatenate(vals))
    return expected


def test_records_are_the_parts_concatenated_and_the_arena_is_reused():
    rng = np.random.default_rng(0)
    arena = Arena()
    builder = PayloadBuilder(arena=arena)
    buffers = []
    for n_parts in (3, 3, 3, 3, 1):
        expected = _queue(builder, rng, n_parts)
        records = builder.take(SPECS)
        assert [r.name for r in records] == ["a", "b"]
        for r in records:
            pos, vals = expected[r.name]
            np.testing.assert_array_equal(r.positions, pos)
            np.testing.assert_array_equal(r.values, vals)
            assert r.values.dtype == vals.dtype and r.positions.dtype == pos.dtype
            if n_parts > 1:
                assert np.shares_memory(r.positions, arena.buf) and np.shares_memory(r.values, arena.buf)
            else:  # one part: as it came (uint32, uint64), not copied
                assert not np.shares_memory(r.positions, arena.buf)
        if n_parts > 1:
            buffers.append(arena.buf)
    # The payloads are no larger than the first (within a factor 2 of growth): one buffer throughout.
    assert all(b is buffers[-1] for b in buffers[1:])


def test_arena_growth_keeps_what_it_handed_out():
    arena = Arena().reset()
    first = arena.concatenate([np.arange(10, dtype=np.int64), np.arange(5, dtype=np.int64)])
    big = arena.concatenate([np.full(1000, 7, np.uint16), np.full(3000, 9, np.uint16)])  # outgrows the buffer
    np.testing.assert_array_equal(first, np.r_[np.arange(10), np.arange(5)])
    assert (big[:1000] == 7).all() and (big[1000:] == 9).all()
    assert not np.shares_memory(first, big)
    one = np.arange(3)
    assert arena.concatenate([one]) is one  # a single part is not copied
    narrow = np.arange(3, dtype=np.uint32)
    wide = arena.concatenate([narrow], np.uint64)  # ... unless it must widen
    assert wide.dtype == np.uint64 and np.shares_memory(wide, arena.buf) and list(wide) == [0, 1, 2]


def test_parts_end_to_end_in_one_buffer_are_one_view():
    """Parts that lie end to end in one buffer (the diff's chunks of a range) come back as
    one view of it; a gap, another buffer, another dtype or a widening copies."""
    arena = Arena().reset()
    buf = np.arange(100, dtype=np.int32)
    parts = [buf[10:20].view(np.uint32), buf[20:20].view(np.uint32), buf[20:45].view(np.uint32)]
    joined = arena.concatenate(parts, np.uint32)
    assert joined.dtype == np.uint32 and not np.shares_memory(joined, arena.buf)
    assert np.shares_memory(joined, buf) and list(joined) == list(range(10, 45))
    copies = [([buf[10:20], buf[21:30]], np.int32), ([buf[10:20], np.arange(5, dtype=np.int32)], np.int32),
              ([buf[10:20].view(np.uint32), buf[20:30].view(np.uint32)], np.uint64),
              ([buf[10:20], buf[20:30].view(np.uint32)], np.int32)]
    for arrays, dtype in copies:
        out = arena.concatenate(arrays, dtype)
        assert np.shares_memory(out, arena.buf) and not np.shares_memory(out, buf)
        np.testing.assert_array_equal(out, np.concatenate(arrays).astype(dtype))


def test_parts_not_known_increasing_are_checked_and_sorted():
    """Parts placed through pieces that are not monotone: the record is checked for order
    and sorted (with its values) only when it needs to be, for uint32 and uint64 positions."""
    for dtype in (np.uint32, np.uint64):
        builder = PayloadBuilder()
        builder.add("a", Op.XOR, np.array([5, 9], dtype), np.array([1, 2], np.uint16))
        builder.add("a", Op.XOR, np.array([2, 7], dtype), np.array([3, 4], np.uint16))
        builder.add("b", Op.XOR, np.array([1, 4], dtype), np.array([5, 6], np.uint16))
        builder.add("b", Op.XOR, np.array([6, 8], dtype), np.array([7, 8], np.uint16))
        a, b = builder.take(SPECS | {"b": ("BF16", (1000,))})
        assert a.positions.tolist() == [2, 5, 7, 9] and a.values.tolist() == [3, 1, 4, 2]
        assert b.positions.tolist() == [1, 4, 6, 8] and b.values.tolist() == [5, 6, 7, 8]
        assert a.positions.dtype == b.positions.dtype == dtype
