"""The commit log: where commit records live, one per committed version, each created
with compare-and-set semantics, so two coordinators can never both commit the same
version; the newest record is the committed version (`nemo_dcr.commit.Coordinator` writes
them). By default a file `commits/v<target>.json` created with O_EXCL in the coordinator's
state directory (`DirectoryCommitLog`); transports whose peers share no file system keep
the records elsewhere (`Transport.commit_log`), e.g. as conditional writes in object storage.
Also here: the digest of a set of payload ids, which a commit checks every receiver applied.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from abc import ABC, abstractmethod

from nemo_dcr.records import TransferInfo


class AlreadyCommitted(Exception):
    """Another coordinator committed this version first."""


class CommitLog(ABC):
    """Where commit records live; the newest one is the committed version."""

    @abstractmethod
    def latest(self) -> int:
        """The highest committed version (0 when nothing was committed)."""

    @abstractmethod
    def write(self, info: TransferInfo, extra: dict) -> None:
        """Atomically create the record for info.target_version (compare-and-set);
        raise AlreadyCommitted if it exists."""

    @staticmethod
    def record(info: TransferInfo, extra: dict) -> bytes:
        return json.dumps({**info.to_json(), **extra, "committed_at": time.time()}, sort_keys=True).encode()


class DirectoryCommitLog(CommitLog):
    """Commit records as files `commits/v<N>.json` in a (shared) directory."""

    _NAME = re.compile(r"^v(\d{8,})\.json$")

    def __init__(self, directory: str | os.PathLike):
        self.dir = os.path.join(os.fspath(directory), "commits")
        os.makedirs(self.dir, exist_ok=True)

    def latest(self) -> int:
        versions = [int(m.group(1)) for f in os.listdir(self.dir) if (m := self._NAME.match(f))]
        return max(versions, default=0)

    def write(self, info: TransferInfo, extra: dict) -> None:
        path = os.path.join(self.dir, f"v{info.target_version:08d}.json")
        body = self.record(info, extra)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise AlreadyCommitted(path) from None
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)


def commit_log_for(transport, state_dir: str) -> CommitLog:
    """The transport's own commit log, else files in `state_dir`."""
    return transport.commit_log(state_dir) or DirectoryCommitLog(state_dir)




def payload_set_digest(payload_ids) -> str:
    """Order-free digest of a set of payload ids (what a receiver applied)."""
    return hashlib.blake2b("\n".join(sorted(set(payload_ids))).encode(), digest_size=16).hexdigest()
