"""Commit records: compare-and-set, so a version is committed once."""

from __future__ import annotations

import pytest

from nemo_dcr.commit_log import AlreadyCommitted, DirectoryCommitLog
from nemo_dcr.records import TransferInfo


def test_a_version_is_committed_once(tmp_path):
    log, other = DirectoryCommitLog(tmp_path), DirectoryCommitLog(tmp_path)  # two coordinators
    assert log.latest() == 0
    log.write(TransferInfo("a", 0, 1, ("p0",)), {})
    with pytest.raises(AlreadyCommitted):
        other.write(TransferInfo("b", 0, 1, ("p0",)), {})
    other.write(TransferInfo("c", 1, 2, ("p0",)), {})
    assert log.latest() == other.latest() == 2
    assert (tmp_path / "commits" / "v00000001.json").read_text().count('"transfer_id": "a"') == 1
