"""A payload's records decoded on several threads: the same records, and a rejection that
names the same record, as one thread gives."""

from __future__ import annotations

import gc
import mmap

import numpy as np
import pytest
import torch

from nemo_dcr.errors import PayloadRejected
from nemo_dcr.receiver import Receiver
from nemo_dcr.records import BaseSpan, Op, Payload, PayloadHeader, Record
from nemo_dcr.runtimes import scatter
from nemo_dcr.runtimes.store import TensorStoreRuntime
from nemo_dcr.wire import codec

from .test_conditioned_coding import adam_like, changes, held_bits

HDR = PayloadHeader("t", 0, 1, "p0", "p0-000000")


def mixed_payload(n=1 << 15, tensors=6):
    """Conditioned, plain xor/add and overwrite records of several tensors: (bytes, old bits)."""
    records, olds = [], {}
    for i in range(tensors):
        old, new = adam_like(n, 1e-5, 10 + i)
        op = (Op.ADD, Op.XOR, Op.OVERWRITE)[i % 3]
        pos, vals = changes(old, new, Op.XOR if op is Op.OVERWRITE else op)
        if op is Op.OVERWRITE:
            vals = new[pos.astype(np.int64)]
        base = BaseSpan(0, old) if i % 2 == 0 and op is not Op.OVERWRITE else None
        records.append(Record(f"w{i}", "BF16", (n,), op, pos, vals, base=base))
        olds[f"w{i}"] = old
    return codec.encode(Payload(HDR, records)), olds


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_records_decoded_on_threads_equal_one_thread(threads):
    data, olds = mixed_payload()
    assert '"gaps_conditioned"' in codec.header_text(data)
    one = codec.decode(data, baselines=held_bits(**olds)).records
    many = codec.decode(data, baselines=held_bits(**olds), threads=threads).records
    assert [r.name for r in many] == [r.name for r in one] == [f"w{i}" for i in range(6)]
    for a, b in zip(one, many):
        assert a.op == b.op and np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values)


def test_a_rejection_names_the_first_bad_record_in_order():
    data, olds = mixed_payload()
    wrong = dict(olds)
    for name in ("w0", "w4"):  # two conditioned records against other bits: w0 is named
        wrong[name] = olds[name].copy()
        wrong[name][7] ^= 1
    for threads in (1, 4):
        with pytest.raises(PayloadRejected, match=r"record 'w0'.*baseline digest differs"):
            codec.decode(data, baselines=held_bits(**wrong), threads=threads)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", None])
def test_threads_must_be_a_positive_int(bad):
    data, olds = mixed_payload(n=4096, tensors=2)
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        codec.decode(data, baselines=held_bits(**olds), threads=bad)


def test_a_receiver_decodes_on_the_cores_it_may_use_unless_told():
    served = {"w": torch.zeros(4)}
    assert Receiver("rx", TensorStoreRuntime(served), None).decode_threads == scatter.default_threads(cap=None)
    assert Receiver("rx", TensorStoreRuntime(served), None, decode_threads=3).decode_threads == 3
    with pytest.raises(ValueError, match="decode_threads must be a positive integer"):
        Receiver("rx", TensorStoreRuntime(served), None, decode_threads=0)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_rejected_payload_lets_go_of_its_buffer_at_once(tmp_path, threads):
    """The local transport unmaps a payload when it is released: a rejection on pool
    threads must leave nothing (no reference cycle until a garbage collection) holding it."""
    data, olds = mixed_payload()
    path = tmp_path / "payload"
    path.write_bytes(data)
    gc.disable()
    try:
        for baselines in (None, held_bits(**olds)):  # rejected (no baselines), then accepted
            with open(path, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            view = memoryview(mm)
            try:
                codec.decode(view, baselines=baselines, threads=threads)
            except PayloadRejected as e:
                assert baselines is None and "does not hold" in e.reason
            view.release()
            mm.close()  # BufferError if anything still holds the buffer
    finally:
        gc.enable()
