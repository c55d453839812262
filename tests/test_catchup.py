"""Catch-up from the refit history: anchors plus committed deltas, replayed exactly once
and in order, gaps and pruned links reported before any write. Real HF receivers, a
trainer over the local transport, a history in a directory or in an S3 bucket (moto)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from nemo_dcr.history import ANCHORS, DELTAS, DirectoryHistory, HistoryError
from nemo_dcr.receiver import Receiver
from nemo_dcr.runtimes.hf import HFRuntime
from nemo_dcr.verify import bit_mismatches
from tests.support.faults import HalfApply
from tests.support.wait import serving
from tests.test_local_refit import Setup, checkpoint  # noqa: F401 - the module-scoped checkpoint fixture

pytestmark = pytest.mark.usefixtures("single_rank_group")
KEY = b"history-key"


def _fresh(checkpoint, history, rx="late", **kw) -> Receiver:
    """A receiver process that just started: the initial checkpoint loaded (version 0)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    return Receiver(rx, HFRuntime(model, checkpoint_dir=checkpoint), None, key=KEY, history=history, **kw)


def _refits(s: Setup, n: int) -> None:
    for _ in range(n):
        s.step()
        assert s.refit.refit().decision.committed


@pytest.fixture(params=["directory", "s3"])
def history(request, tmp_path):
    if request.param == "directory":
        yield DirectoryHistory(tmp_path / "history")
        return
    from nemo_dcr.transports.s3_history import S3History
    from tests.support.transports import open_transport

    bucket = open_transport("s3", tmp_path, ["unused"])  # only its bucket: the refits go over "local"
    hist = S3History(bucket)
    yield hist
    hist.close()
    bucket.cleanup()


def test_history_replays_deltas_and_anchors_with_pruning(checkpoint, tmp_path, history):
    hist = history
    s = Setup(checkpoint, tmp_path, n_receivers=1, key=KEY,
              refit_kw={"history": hist, "anchor_every": 2, "keep_anchors": 2})
    try:
        assert hist.versions(ANCHORS) == [0]  # written at set-up: catch-up always has a start
        _refits(s, 3)
        assert hist.versions(ANCHORS) == [0, 2] and hist.versions(DELTAS) == [1, 2, 3]
        late = _fresh(checkpoint, hist)  # known bits (v0): deltas only
        report = late.catch_up()
        assert (report.anchor, report.deltas, late.serving_version) == (None, [1, 2, 3], 3)
        assert bit_mismatches(s.expected(), late.runtime.canonical_state()) == []

        _refits(s, 2)  # v5; anchor v4 written, v0 and the deltas up to v2 pruned
        assert hist.versions(ANCHORS) == [2, 4] and hist.versions(DELTAS) == [3, 4, 5]
        fresh = _fresh(checkpoint, hist)  # v0's deltas are gone: it must start from an anchor
        report = fresh.catch_up()
        assert (report.anchor, report.deltas, fresh.serving_version) == (4, [5], 5)
        assert bit_mismatches(s.expected(), fresh.runtime.canonical_state()) == []
        report = late.catch_up()  # v3 -> v5 by deltas
        assert (report.anchor, report.deltas) == (None, [4, 5])
        assert bit_mismatches(s.expected(), late.runtime.canonical_state()) == []

        late.uncertain_state = "bits unknown (test)"  # unknown bits: an anchor, whatever it serves
        report = late.catch_up()
        assert report.anchor == 4 and late.uncertain_state is None
        assert bit_mismatches(s.expected(), late.runtime.canonical_state()) == []
    finally:
        s.close()


def test_gaps_tampering_and_corruption_are_reported_before_any_write(checkpoint, tmp_path):
    hist = DirectoryHistory(tmp_path / "history")
    s = Setup(checkpoint, tmp_path, n_receivers=1, key=KEY, refit_kw={"history": hist, "anchor_every": 0})
    try:
        _refits(s, 3)
        rx = _fresh(checkpoint, hist)
        before = {k: v.clone() for k, v in rx.runtime.canonical_state().items()}

        def unchanged():
            assert bit_mismatches(before, rx.runtime.canonical_state()) == [] and rx.serving_version == 0

        # a missing link: v2's manifest gone (never stored or pruned)
        v2 = tmp_path / "history" / "deltas" / "v00000002" / "manifest.json"
        saved = v2.read_bytes()
        v2.unlink()
        with pytest.raises(HistoryError, match="delta of version 2 is missing"):
            rx.catch_up()
        unchanged()
        # a manifest altered without the key: refused
        meta = json.loads(saved)
        meta["payloads"] = dict(list(meta["payloads"].items())[:1])
        v2.write_text(json.dumps(meta))
        with pytest.raises(HistoryError, match="cannot be trusted"):
            rx.catch_up()
        unchanged()
        v2.write_bytes(saved)
        # a corrupted payload in v3: v1 and v2 apply, v3 is refused whole before its first write
        folder = tmp_path / "history" / "deltas" / "v00000003"
        victim = sorted(p for p in os.listdir(folder) if p.endswith(".ndcr"))[-1]
        data = bytearray((folder / victim).read_bytes())
        data[len(data) // 2] ^= 1
        (folder / victim).write_bytes(bytes(data))
        with pytest.raises(HistoryError, match="checksum|MAC"):
            rx.catch_up()
        assert rx.serving_version == 2 and rx.uncertain_state is None
    finally:
        s.close()


def test_uncertain_receiver_catches_up_on_the_next_begin(checkpoint, tmp_path):
    """Every attempt of transfer 1 is interrupted on rx0 (half-applied), so it is
    aborted and rx0's bits are unknown; with a history rx0 repairs itself from the
    anchor when the next transfer begins, and that transfer commits bit-exact."""
    hist = DirectoryHistory(tmp_path / "history")
    flaky = {}
    s = Setup(checkpoint, tmp_path, key=KEY, max_attempts=2,
              runtime_wrapper=lambda rx, rt: flaky.setdefault(
                  rx, HalfApply(rt, crash_on=(1, 2) if rx == "rx0" else ())),
              refit_kw={"history": hist}, receiver_kw={"history": hist})
    try:
        s.step()
        with pytest.raises(Exception, match="did not commit"):
            s.refit.refit()
        assert flaky["rx0"].crashes == 2
        s.step()
        result = s.refit.refit()
        assert result.decision.committed and result.decision.version == 1
        serving(s.receivers, 1)
        for r in s.receivers:
            assert bit_mismatches(s.expected(), r.runtime.canonical_state()) == [], r.id
    finally:
        s.close()
