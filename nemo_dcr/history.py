"""Refit history: anchors and committed deltas, kept for receivers that must catch up.

A receiver that restarted, joined late, or whose bits became uncertain cannot take the
next delta: it needs the committed version first. The trainer therefore keeps, in a
history store shared with the rollout side (a directory, or the S3 bucket of the s3
transport):

    deltas/v{N:08d}/{payload_id}.ndcr    the payloads that took version N-1 to N (as encoded,
                                         one per payload id: the attempt that last sent it)
    deltas/v{N:08d}/manifest.json        {version, payloads: {payload id: transfer id}}
    anchors/v{N:08d}/{payload_id}.ndcr   every canonical element at version N, as overwrites
    anchors/v{N:08d}/manifest.json       {version, payloads: {payload id: transfer id}}

A manifest is written after all its payloads, so a version without one is incomplete and
counts as missing. With a key, manifests carry an HMAC (`control_auth`), payloads their
own. Anchors are written every `anchor_every` versions; after each, all but the newest
`keep_anchors` anchors are pruned together with the deltas only they needed.
`nemo_dcr.catchup` replays the newest usable anchor and the deltas after it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from abc import ABC, abstractmethod

from nemo_dcr.control_auth import check, sign
from nemo_dcr.errors import DCRError

DELTAS, ANCHORS = "deltas", "anchors"
_VERSION = re.compile(r"^v(\d{8,})$")


class HistoryError(DCRError):
    """The history cannot take a receiver to the version asked for (a gap, a pruned or
    incomplete link, a manifest that fails its check)."""


class HistoryMissing(HistoryError):
    """A named blob is not in the history."""


class History(ABC):
    """Named blobs under two folders; subclasses say where they live."""

    @abstractmethod
    def put(self, name: str, data: bytes) -> None: ...

    @abstractmethod
    def get(self, name: str) -> bytes:
        """The blob, or HistoryMissing naming it when it is not there."""

    @abstractmethod
    def names(self, folder: str) -> list[str]:
        """Names of the entries directly under `folder` (one level)."""

    @abstractmethod
    def remove(self, folder: str) -> None:
        """Delete everything under `folder`."""

    # --- layout ------------------------------------------------------------------

    @staticmethod
    def folder(kind: str, version: int) -> str:
        if kind not in (DELTAS, ANCHORS):
            raise ValueError(f"history kind must be {DELTAS!r} or {ANCHORS!r}, got {kind!r}")
        return f"{kind}/v{int(version):08d}"

    def put_payload(self, kind: str, version: int, payload_id: str, data: bytes) -> None:
        self.put(f"{self.folder(kind, version)}/{payload_id}.ndcr", data)

    def get_payload(self, kind: str, version: int, payload_id: str) -> bytes:
        return self.get(f"{self.folder(kind, version)}/{payload_id}.ndcr")

    def put_manifest(self, kind: str, version: int, payloads: dict[str, str], key: bytes | None) -> None:
        body = sign(key, kind, {"version": int(version), "payloads": dict(sorted(payloads.items()))})
        self.put(f"{self.folder(kind, version)}/manifest.json", json.dumps(body, sort_keys=True).encode())

    def manifest(self, kind: str, version: int, key: bytes | None) -> dict[str, str] | None:
        """{payload id: transfer id} of a complete entry; None when it is absent or
        incomplete; HistoryError when it is there but fails its check."""
        name = f"{self.folder(kind, version)}/manifest.json"
        try:
            meta = json.loads(self.get(name))
        except HistoryMissing:
            return None
        except (ValueError, UnicodeDecodeError) as e:
            raise HistoryError(f"history: {name} is not a manifest ({e})") from None
        why = check(key, kind, meta) if isinstance(meta, dict) else "not an object"
        if why is None and (meta.get("version") != version or not isinstance(meta.get("payloads"), dict)):
            why = f"it describes version {meta.get('version')!r}"
        if why is not None:
            raise HistoryError(f"history: {name} cannot be trusted: {why}")
        return {str(p): str(t) for p, t in meta["payloads"].items()}

    def versions(self, kind: str) -> list[int]:
        """Versions with an entry of `kind` (complete or not), ascending."""
        return sorted(int(m.group(1)) for n in self.names(kind) if (m := _VERSION.match(n)))

    def prune(self, keep_anchors: int, key: bytes | None) -> list[str]:
        """Keep the newest `keep_anchors` complete anchors and the deltas after the oldest
        of them; remove the rest (oldest first). Returns what was removed."""
        complete = [v for v in self.versions(ANCHORS) if self.manifest(ANCHORS, v, key) is not None]
        if keep_anchors < 1 or len(complete) <= keep_anchors:
            return []
        oldest_kept = complete[-keep_anchors]
        gone = [self.folder(ANCHORS, v) for v in self.versions(ANCHORS) if v < oldest_kept]
        gone += [self.folder(DELTAS, v) for v in self.versions(DELTAS) if v <= oldest_kept]
        for folder in gone:
            self.remove(folder)
        return gone


class DirectoryHistory(History):
    """History in a directory (a shared file system); writes are atomic renames."""

    def __init__(self, root: str | os.PathLike):
        self.root = os.fspath(root)
        os.makedirs(self.root, exist_ok=True)

    def _path(self, name: str) -> str:
        if name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"history: bad name {name!r}")
        return os.path.join(self.root, *name.split("/"))

    def put(self, name: str, data: bytes) -> None:
        path = self._path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def get(self, name: str) -> bytes:
        try:
            with open(self._path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise HistoryMissing(f"history: {name} is missing (in {self.root})") from None

    def names(self, folder: str) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self._path(folder)) if ".tmp" not in n)
        except FileNotFoundError:
            return []

    def remove(self, folder: str) -> None:
        shutil.rmtree(self._path(folder), ignore_errors=True)


def open_history(spec, transport=None) -> History | None:
    """A history from a configuration value: None, a History, a directory path, or the
    name of the transport in use (e.g. "s3"): that transport's own store
    (`Transport.history()`), shared by the trainer and the receivers."""
    if spec is None or isinstance(spec, History):
        return spec
    if isinstance(spec, str) and spec in _transport_names():
        own = transport.history() if transport is not None and getattr(transport, "name", None) == spec else None
        if own is None:
            raise ValueError(f"history {spec!r} keeps anchors and deltas in the {spec} transport's own store: "
                             f"use it with the {spec} transport (which must keep one), or give a directory")
        return own
    if isinstance(spec, (str, os.PathLike)):
        return DirectoryHistory(spec)
    raise ValueError(f"history: expected a directory, a transport's name or a History, got {spec!r}")


def _transport_names() -> list[str]:
    from nemo_dcr import registry

    return registry.available("nemo_dcr.transports")
