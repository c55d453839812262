"""The whole-state digest checked in real refits (local transport, Hugging Face receivers,
one trainer process): a receiver that does not hold the producers' base is refused at
begin, names the mismatch, is resynced densely from the producers' shares with no
operator action, and the refit goes on; a receiver whose apply went wrong is caught
before the commit and repaired in place. Oracle: the receivers' bits against the
trainer's, element by element, after every refit."""

from __future__ import annotations

import pytest
import torch

from nemo_dcr import dtypes
from nemo_dcr.errors import TransferFailed
from nemo_dcr.records import Op, Record
from nemo_dcr.runtimes.base import RuntimeAdapter
from nemo_dcr.verify import bit_mismatches
from tests.support.wait import serving
from tests.test_local_refit import Setup, checkpoint, tiny_checkpoint  # noqa: F401 - checkpoint: a fixture

pytestmark = pytest.mark.usefixtures("single_rank_group")


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    """Same architecture and shapes as `checkpoint`, another seed."""
    return tiny_checkpoint(tmp_path_factory.mktemp("other"), seed=1)


def _refit_resyncs(s: Setup, version: int, receivers: list[str]) -> None:
    """A training step and a refit that commits `version` after resyncing `receivers`."""
    s.step()
    result = s.refit.refit()
    assert result.decision.committed and result.decision.version == version
    assert result.resynced == receivers
    _exact(s, version)


def _exact(s: Setup, version: int) -> None:
    serving(s.receivers, version)
    for r in s.receivers:
        assert bit_mismatches(s.expected(), r.runtime.canonical_state()) == [], r.id
        assert r.state_digest == r.runtime.state_digest().hex(), r.id  # kept = read back


@pytest.mark.parametrize("transport", ["local", "relay", "s3"])
def test_receiver_on_another_checkpoint_is_caught_resynced_and_exact(checkpoint, other_checkpoint, tmp_path,
                                                                      transport):
    logs = []
    s = Setup(checkpoint, tmp_path, receiver_checkpoints={"rx1": other_checkpoint},
              refit_kw={"log": logs.append}, transport=transport)
    try:
        assert s.receivers[0].state_digest == s.refit.state_digest != s.receivers[1].state_digest
        for version in (1, 2, 3):
            s.step()
            result = s.refit.refit()
            assert result.decision.committed and result.decision.version == version
            # the first refit resyncs rx1 (only it), the others need nothing more
            assert result.resynced == (["rx1"] if version == 1 else [])
            m = result.metrics()
            assert m["resynced_receivers"] == (1 if version == 1 else 0)
            assert m["digest_checked_receivers"] == 2
            assert m["state_digest"] == s.refit.state_digest != m["base_state_digest"]
            _exact(s, version)
        assert s.receivers[1].resyncs == 1 and s.receivers[0].resyncs == 0
        said = "\n".join(logs)
        assert "receiver rx1 does not hold version 0" in said and "tensors that differ" in said
        assert "model.layers.0.self_attn.q_proj.weight" in said  # named, from the digests alone
    finally:
        s.close()


def test_memory_corruption_between_refits_is_caught_at_the_next_begin(checkpoint, tmp_path):
    """One flipped bit in a tensor no delta touches (a frozen parameter), between two
    refits: a receiver that rescans at begin refuses, is resynced, and ends exact."""
    frozen = "model.norm.weight"
    s = Setup(checkpoint, tmp_path, receiver_kw={"rescan": True},
              trainer_setup=lambda m: m.model.norm.weight.requires_grad_(False))
    try:
        _refit_resyncs(s, 1, [])
        bits = dtypes.bits_of(s.receivers[0].runtime.canonical_state()[frozen].detach()).view(-1)
        bits[5] ^= 1 << 4  # behind the library's back
        _refit_resyncs(s, 2, ["rx0"])
    finally:
        s.close()


def test_receiver_with_random_weights_is_resynced_on_its_first_refit(checkpoint, tmp_path):
    """A receiver that starts from random weights of the right shapes (as an engine
    loaded with dummy weights does) is caught and resynced by its first refit."""

    def randomize(rx, runtime):
        if rx == "rx0":
            with torch.no_grad():
                for t in runtime.canonical_state().values():
                    t.normal_()
        return runtime

    s = Setup(checkpoint, tmp_path, runtime_wrapper=randomize)
    try:
        _refit_resyncs(s, 1, ["rx0"])
    finally:
        s.close()


class DropsOneRecord(RuntimeAdapter):
    """Applies through `inner`, except that the first xor/add record of the first call
    that has one is silently skipped (a lost write its undo log does not admit)."""

    def __init__(self, inner):
        self.inner, self.dropped = inner, None

    def catalog(self):
        return self.inner.catalog()

    def check(self, records):
        return self.inner.check(records)

    def canonical_state(self):
        return self.inner.canonical_state()

    def state_digest(self):
        return self.inner.state_digest()

    def apply(self, records):
        records = list(records)
        if self.dropped is None:
            i = next((k for k, r in enumerate(records) if r.op is not Op.OVERWRITE and len(r)), None)
            if i is not None:
                self.dropped = records.pop(i)
        return self.inner.apply(records)

    def revert(self, log):
        return self.inner.revert(log)


def test_lost_write_is_caught_before_the_commit_and_repaired_in_place(checkpoint, tmp_path):
    wrappers = {}

    def wrap(rx, runtime):
        wrappers[rx] = DropsOneRecord(runtime) if rx == "rx1" else runtime
        return wrappers[rx]

    logs = []
    s = Setup(checkpoint, tmp_path, runtime_wrapper=wrap, refit_kw={"log": logs.append})
    try:
        s.step()
        result = s.refit.refit()
        assert isinstance(wrappers["rx1"].dropped, Record)
        assert result.decision.committed and result.attempts == 2  # the second attempt re-sent it
        said = "\n".join(logs)
        assert "rx1: holds state digest" in said and "payloads that moved it differently" in said
        _exact(s, 1)
    finally:
        s.close()


def test_without_a_resync_a_wrong_base_fails_closed(checkpoint, other_checkpoint, tmp_path):
    """When the resync itself cannot run (here every resync payload is rejected), the
    refit fails closed: nothing commits, the good receiver stays at the base."""
    s = Setup(checkpoint, tmp_path, receiver_checkpoints={"rx1": other_checkpoint}, max_attempts=1,
              receiver_kw={"max_staged_bytes": 1})
    try:
        s.step()
        with pytest.raises(TransferFailed, match="does not hold version 0"):
            s.refit.refit()
        assert all(r.serving_version == 0 for r in s.receivers)
        assert s.receivers[0].state_digest == s.refit.state_digest
    finally:
        s.close()
