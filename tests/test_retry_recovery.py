"""In-place recovery of a failed transfer: the receivers' apply journal, retries that
re-send what may be half-applied as overwrites, replays dropped by identity, and the
fail-closed end when retries run out. Real HF receivers over the local transport."""

from __future__ import annotations

import pytest

from nemo_dcr.errors import TransferFailed
from nemo_dcr.records import Op
from nemo_dcr.verify import bit_mismatches
from tests.support.faults import FaultyEnd, FaultyRuntime, HalfApply, SilentCorruption
from tests.support.wait import serving, until
from tests.test_local_refit import Setup, checkpoint  # noqa: F401 - the module-scoped checkpoint fixture

pytestmark = pytest.mark.usefixtures("single_rank_group")


def _exact(s: Setup) -> None:
    for r in s.receivers:
        assert bit_mismatches(s.expected(), r.runtime.canonical_state()) == [], r.id


def _spy_ops(receiver):
    """Record the operations of every payload the receiver stages, per attempt."""
    seen: dict[int, set] = {}
    real = receiver._maybe_apply

    def spy():
        cur = receiver.current
        if cur is not None:
            for payload in cur.staged.values():
                seen.setdefault(cur.info.attempt, set()).update(Op(r.op) for r in payload.records)
        real()
    receiver._maybe_apply = spy
    return seen


@pytest.mark.parametrize("op", [Op.XOR, Op.ADD])
def test_half_applied_payload_is_repaired_by_overwrites(checkpoint, tmp_path, op):
    """rx0's 4th apply call is interrupted after half its records: the retry re-sends,
    as overwrites, every payload not finished everywhere; rx1 drops the ones it finished;
    both end bit-exact at v1 and the joint commit proceeds."""
    flaky = {}
    s = Setup(checkpoint, tmp_path, op=op, runtime_wrapper=lambda rx, rt: flaky.setdefault(
        rx, HalfApply(rt, crash_on=(4,) if rx == "rx0" else ())))
    ops = _spy_ops(s.receivers[0])
    try:
        s.step()
        result = s.refit.refit()
        assert flaky["rx0"].crashes == 1
        assert result.decision.committed and result.attempts == 2
        m = result.metrics()
        assert m["retries"] == 1 and m["recovered"] is True
        assert m["receiver_dropped_payloads"] > 0  # rx1 finished them in attempt 1: dropped by identity
        assert ops[0] == {op} and ops[1] == {Op.OVERWRITE}  # never a second delta
        retry_report = result.producers[0]
        assert 0 < len(retry_report["payload_ids"]) < len(retry_report["all_payload_ids"])  # finished ones skipped
        serving(s.receivers, 1)
        _exact(s)
        s.step()  # the next transfer is an ordinary delta against v1
        assert s.refit.refit().attempts == 1
        serving(s.receivers, 2)
        _exact(s)
    finally:
        s.close()


def test_a_batch_whose_end_fails_is_reverted_whole_and_retried(checkpoint, tmp_path):
    """rx0's runtime fails when its batch ends (after every apply of the batch succeeded):
    the receiver reverts all of them, answers the error, and the retry re-sends them;
    both receivers end bit-exact at v1."""
    runtimes = {}
    s = Setup(checkpoint, tmp_path, runtime_wrapper=lambda rx, rt: runtimes.setdefault(rx, FaultyRuntime(rt)))
    try:
        runtimes["rx0"].fail_batch_end = True
        s.step()
        result = s.refit.refit()
        assert result.decision.committed and result.attempts == 2
        assert not runtimes["rx0"].fail_batch_end  # it did fail once
        serving(s.receivers, 1)
        _exact(s)
    finally:
        s.close()


@pytest.mark.parametrize("fault", ["drop", "corrupt"])
def test_lost_or_corrupted_payload_is_resent(checkpoint, tmp_path, fault):
    s = Setup(checkpoint, tmp_path, timeout_s=3)
    try:
        s.step()
        end = s.refit.producer.end = FaultyEnd(s.refit.producer.end, {"p0-000002": fault})
        result = s.refit.refit()
        assert end.injected[fault] == 1
        assert result.decision.committed and result.attempts == 2
        serving(s.receivers, 1)
        _exact(s)
    finally:
        s.close()


def test_duplicated_and_reordered_payloads_need_no_retry(checkpoint, tmp_path):
    s = Setup(checkpoint, tmp_path)
    try:
        s.step()
        end = s.refit.producer.end = FaultyEnd(s.refit.producer.end, {"p0-000001": "duplicate", "p0-000003": "delay"})
        result = s.refit.refit()
        assert end.injected["duplicate"] == end.injected["delay"] == 1
        assert result.decision.committed and result.attempts == 1
        serving(s.receivers, 1)
        _exact(s)
    finally:
        s.close()


def test_retries_exhausted_fail_closed_and_name_the_uncertain_receiver(checkpoint, tmp_path):
    """Every attempt is interrupted on rx0: the transfer is aborted; rx1 reverts to v0
    exactly, rx0 (bits unknown) refuses the next transfer with a reason naming it."""
    s = Setup(checkpoint, tmp_path, max_attempts=2, runtime_wrapper=lambda rx, rt: HalfApply(
        rt, crash_on=range(1, 10_000) if rx == "rx0" else ()))
    before = {k: v.clone() for k, v in s.receivers[1].runtime.canonical_state().items()}
    try:
        s.step()
        with pytest.raises(TransferFailed, match="after 2 attempt"):
            s.refit.refit()
        assert s.refit.baseline.version == 0 and not s.refit.baseline.in_flight
        until(lambda: all(r.lineage is None for r in s.receivers), what="the abort reaching every receiver")
        assert all(r.serving_version == 0 for r in s.receivers)
        assert bit_mismatches(before, s.receivers[1].runtime.canonical_state()) == []
        with pytest.raises(TransferFailed, match="rx0 cannot take transfers: .*catch up from an anchor"):
            s.refit.refit()
    finally:
        s.close()


def test_receiver_that_missed_the_commit_adopts_it_on_the_next_begin(checkpoint, tmp_path):
    s = Setup(checkpoint, tmp_path, n_receivers=1)
    rx = s.receivers[0]
    real = rx._on_commit
    rx._on_commit = lambda meta: None  # the commit message is lost
    try:
        s.step()
        assert s.refit.refit().decision.committed
        rx._on_commit = real
        s.step()
        assert s.refit.refit().decision.committed and rx.serving_version in (1, 2)
        serving(s.receivers, 2)
        _exact(s)
    finally:
        s.close()


def test_readback_catches_a_silent_corruption_and_the_retry_repairs_it(checkpoint, tmp_path):
    """rx0's 2nd apply call flips one written bit without raising. The payload checksums
    all passed, so only the read-back of applied regions can see it: the attempt fails
    with a reason naming the payload, the retry overwrites, the commit is bit-exact."""
    bad = {}
    s = Setup(checkpoint, tmp_path, refit_kw={"readback": True}, runtime_wrapper=lambda rx, rt: bad.setdefault(
        rx, SilentCorruption(rt, crash_on=(2,) if rx == "rx0" else ())))
    logs = []
    s.refit.log = logs.append
    try:
        s.step()
        result = s.refit.refit()
        assert bad["rx0"].crashes == 1 and result.attempts == 2 and result.decision.committed
        assert "rx0: read-back of payload p0-000001 differs" in logs[0]
        m = result.metrics()
        assert m["receiver_readback_s"] > 0 and m["producer_digest_s"] > 0
        serving(s.receivers, 1)
        _exact(s)
    finally:
        s.close()


def test_without_readback_a_silent_corruption_commits(checkpoint, tmp_path):
    """The control for the test above: checksums and payload sets cannot see it."""
    s = Setup(checkpoint, tmp_path, n_receivers=1, runtime_wrapper=lambda rx, rt: SilentCorruption(rt, (2,)))
    try:
        s.step()
        assert s.refit.refit().attempts == 1
        serving(s.receivers, 1)
        assert len(bit_mismatches(s.expected(), s.receivers[0].runtime.canonical_state())) == 1
    finally:
        s.close()
