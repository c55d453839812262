"""File-backed baselines survive a trainer crash at every point of a transfer: reopened
with the version the commit log names, they hold exactly that version's bits, or they
say why they cannot (and are not used)."""

from __future__ import annotations

import pytest
import torch

from nemo_dcr.baseline import JOURNAL, MANIFEST, Baseline

V0 = torch.arange(10, dtype=torch.int16)
V1 = V0.clone()
V1[[2, 5, 7]] = torch.tensor([-1, -2, -3], dtype=torch.int16)


def fresh(d, fp="fp") -> Baseline:
    b = Baseline(0, d, fingerprint=fp)
    b.register("w[0:10]", V0)
    b.register("u[0:3]", torch.tensor([1, 2, 3], dtype=torch.int32))
    b.seal()
    return b


def transfer(b: Baseline) -> None:
    b.begin(b.version + 1)
    b.stage("w[0:10]", torch.tensor([2, 5]), torch.tensor([-1, -2], dtype=torch.int16))
    b.stage("w[0:10]", torch.tensor([7]), torch.tensor([-3], dtype=torch.int16))


def test_committed_versions_come_back(tmp_path):
    b = fresh(tmp_path)
    transfer(b)
    b.persist_pending()
    assert b.commit() == 1
    b.wait_committed()  # the scatter and the sync run in the background
    assert not (tmp_path / JOURNAL).exists()
    again = Baseline(1, tmp_path, fingerprint="fp")
    assert again.restored and again.version == 1, again.restore_note
    assert torch.equal(again.committed("w[0:10]"), V1)
    assert again.committed("u[0:3]").tolist() == [1, 2, 3] and again.committed("u[0:3]").dtype == torch.int32


def test_a_crash_before_the_commit_record_restores_the_old_version(tmp_path):
    b = fresh(tmp_path)
    transfer(b)
    b.persist_pending()  # then the process dies; the commit log still says 0
    del b
    again = Baseline(0, tmp_path, fingerprint="fp")
    assert again.restored and torch.equal(again.committed("w[0:10]"), V0)
    assert not (tmp_path / JOURNAL).exists()  # the uncommitted journal is gone


def test_a_crash_after_the_commit_record_replays_the_journal(tmp_path, monkeypatch):
    b = fresh(tmp_path)
    transfer(b)
    b.persist_pending()
    # the commit record for v1 exists; the process dies halfway through scattering
    monkeypatch.setattr(Baseline, "_write_manifest", lambda self: (_ for _ in ()).throw(OSError("killed")))
    b._committed["w[0:10]"][2] = -1  # part of the scatter reached the file
    del b
    monkeypatch.undo()
    again = Baseline(1, tmp_path, fingerprint="fp")
    assert again.restored and again.version == 1, again.restore_note
    assert torch.equal(again.committed("w[0:10]"), V1)
    assert Baseline(1, tmp_path, fingerprint="fp").restored  # and the manifest moved on


@pytest.mark.parametrize("version,fp,why", [
    (3, "fp", "it holds version 1, the commit log says 3"),
    (1, "other", "fingerprint differs"),
])
def test_a_baseline_for_something_else_is_not_used(tmp_path, version, fp, why):
    b = fresh(tmp_path)
    transfer(b)
    b.persist_pending()
    b.commit()
    b.wait_committed()
    again = Baseline(version, tmp_path, fingerprint=fp)
    assert not again.restored and why in again.restore_note and list(again.keys()) == []


def test_no_manifest_no_restore_and_a_torn_journal_is_ignored(tmp_path):
    assert not Baseline(0, tmp_path / "empty").restored
    b = fresh(tmp_path)
    (tmp_path / (JOURNAL + ".tmp")).mkdir()  # a journal being written when the process died
    assert (tmp_path / MANIFEST).exists()
    again = Baseline(0, tmp_path, fingerprint="fp")
    assert again.restored and not (tmp_path / (JOURNAL + ".tmp")).exists()
    del b


def test_abort_drops_the_journal(tmp_path):
    b = fresh(tmp_path)
    transfer(b)
    b.persist_pending()
    b.abort()
    assert not (tmp_path / JOURNAL).exists() and torch.equal(b.committed("w[0:10]"), V0)


def test_a_failed_background_sync_is_reported_and_the_journal_still_restores(tmp_path, monkeypatch):
    """commit() scatters and syncs after it returns; if the sync fails (disk error), the
    next begin() says so, and the kept journal brings the committed version back."""
    b = fresh(tmp_path)
    transfer(b)
    b.persist_pending()
    monkeypatch.setattr("nemo_dcr.baseline.os.fsync", lambda fd: (_ for _ in ()).throw(OSError("EIO")))
    assert b.commit() == 1
    with pytest.raises(OSError, match=r"update to version 1 failed \(OSError: EIO\) in .*; its journal is kept"):
        b.begin(2)
    monkeypatch.undo()
    assert torch.equal(b.committed("w[0:10]"), V1)  # reported once; the bits in memory are v1
    assert (tmp_path / JOURNAL).exists()
    again = Baseline(1, tmp_path, fingerprint="fp")
    assert again.restored and again.version == 1, again.restore_note
    assert torch.equal(again.committed("w[0:10]"), V1)
