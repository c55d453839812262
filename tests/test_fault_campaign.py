"""A slice of the fault-injection campaign (tests/fault_campaign.py): one refit per fault
kind that matters for each transport, every one checked against the trainer's dense
state; the full randomized run (--refits 200) is a documented command."""

from __future__ import annotations

import pytest

from tests.fault_campaign import run, table

pytestmark = pytest.mark.usefixtures("single_rank_group")

SCHEDULE = [
    ("local", "none"), ("local", "half"), ("local", "crash"), ("local", "drop"), ("local", "silent"),
    ("local", "stuck"), ("local", "none"), ("local", "wrong_base"), ("local", "dummy"), ("local", "bitflip"),
    ("relay", "kill_relay"), ("relay", "corrupt"), ("relay", "reorder"),
    ("s3", "s3_5xx"), ("s3", "s3_timeout"), ("s3", "duplicate"),
]


def test_every_faulty_refit_converges_or_fails_closed(tmp_path):
    outcomes = run(0, [], seed=0, workdir=tmp_path, schedule=SCHEDULE, log=lambda line: None)
    text, summary = table(outcomes)
    print(text)
    assert len(outcomes) == len(SCHEDULE)
    assert summary["total"]["silent_mismatch"] == 0, text
    # Each fault but "stuck" is recoverable in place; "stuck" fails closed and the refit after it
    # commits (the stuck receiver catches up from the history first).
    assert [o.result for o in outcomes if o.result != "converged"] == ["failed_closed"], text
    stuck = next(o for o in outcomes if o.fault == "stuck")
    assert stuck.result == "failed_closed" and "did not commit after" in stuck.reason and stuck.recover_s > 0
    retried = {(o.transport, o.fault) for o in outcomes if o.attempts > 1}
    assert {("local", "half"), ("local", "crash"), ("local", "drop"), ("local", "silent"),
            ("relay", "corrupt")} <= retried, text
