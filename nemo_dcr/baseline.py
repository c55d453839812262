"""Producer baselines: the bits of the last *committed* version of each owned range.

Not the pre-step bits: a refit can fail or be skipped, and the next delta must be
taken against what receivers actually hold. A transfer in flight keeps only its
sparse changes as pending (positions + new bits), so the producer holds one dense
copy of what it owns, not two; `commit()` scatters the pending changes in.

File-backed baselines (`directory`) also survive a trainer crash. The ranges live in
memory-mapped files; `seal()` writes a manifest (version, fingerprint, ranges);
`persist_pending()` writes the transfer's changes to a journal *before* the coordinator
may write the commit record; `commit()` scatters them in, then syncs the range files,
advances the manifest and drops the journal - in the background, off the refit's
critical path (scattering 3% of a 1 GB file-backed range and syncing it is a large share
of a refit's time);
until then the journal is what makes the version durable, and readers wait
(`wait_committed`). A restarted trainer opens the directory with the version the commit
log names: a journal for that version is replayed (the crash fell between the commit
record and the manifest), a journal for any other version is dropped (it never
committed), and the ranges are restored only when manifest version and fingerprint
match. So after a restart the next transfer starts from exactly what receivers hold,
whatever weights the trainer itself restarted from.

Ranges diffed on a GPU also get a device mirror of their committed bits (`committed_on`):
made from the host copy on first use, updated at `commit()` from the changes staged on
the device (dropped when a transfer diffed the range on the host, e.g. with the weights
offloaded, and made again on next use), so a diff there reads device memory instead of copying the baseline over the
host link every refit. The host copy stays the durable one (a mirror is rebuilt from it
after a restart); the mirror costs one more copy of the owned range in device memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from nemo_dcr.diff import DiffCoordinates

log = logging.getLogger(__name__)

MANIFEST = "baseline.json"
JOURNAL = "journal"


@dataclass
class _Pending:
    positions: list[torch.Tensor] = field(default_factory=list)
    new: list[torch.Tensor] = field(default_factory=list)
    on_device: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # for a device mirror
    coordinates: list[DiffCoordinates | None] = field(default_factory=list)  # see Baseline.stage

    def local_positions(self) -> torch.Tensor:
        """The staged positions, relative to the range, in one tensor."""
        return torch.cat([pos if c is None else c.range_positions(pos)
                          for pos, c in zip(self.positions, self.coordinates)])


class Baseline:
    """Committed bits per owned range, in RAM or file-backed (mmap, restorable)."""

    def __init__(self, version: int = 0, directory: str | os.PathLike | None = None, *,
                 fingerprint: str | None = None):
        self.version = version
        self.directory = None if directory is None else os.fspath(directory)
        self.fingerprint = fingerprint
        self.restored = False  # ranges came back from the directory (see `restore_note`)
        self.restore_note = ""
        self._committed: dict[str, torch.Tensor] = {}
        self._maps: dict[str, np.memmap] = {}  # file-backed ranges, flushed at commit
        self._mirrors: dict[str, torch.Tensor] = {}  # key -> committed bits on a GPU (see committed_on)
        self._pending: dict[str, _Pending] | None = None
        self._pending_target: int | None = None
        self._updating: threading.Thread | None = None  # commit()'s background scatter and sync
        self._update_error: BaseException | None = None
        if self.directory is not None:
            os.makedirs(self.directory, exist_ok=True)
            self._restore()

    def register(self, key: str, bits: torch.Tensor) -> None:
        """Record the committed bits of a range (a copy; `bits` is an integer bit view)."""
        if key in self._committed:
            raise ValueError(f"baseline range {key!r} registered twice")
        src = bits.detach().reshape(-1).cpu()
        if self.directory is None:
            self._committed[key] = src.clone()
            return
        mm = np.memmap(self._path(key), dtype=_np_dtype(src.dtype), mode="w+", shape=(src.numel(),))
        mm[:] = src.numpy()
        mm.flush()
        self._maps[key] = mm
        self._committed[key] = torch.from_numpy(mm)

    def committed(self, key: str) -> torch.Tensor:
        self.wait_committed()
        return self._committed[key]

    def committed_on(self, key: str, device: torch.device) -> torch.Tensor:
        """The committed bits of `key` on `device`: the host copy for the CPU, else a mirror
        kept on that device (made on first use, kept current by `commit`)."""
        if device.type == "cpu":
            return self.committed(key)
        mirror = self._mirrors.get(key)
        if mirror is None or mirror.device != device:
            mirror = self._mirrors[key] = self.committed(key).to(device)
        return mirror

    def keys(self):
        return self._committed.keys()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._committed.values())

    # --- transfer lifecycle -------------------------------------------------------

    def begin(self, target_version: int) -> None:
        self.wait_committed()
        if target_version != self.version + 1:
            raise ValueError(f"baseline at version {self.version} cannot start a transfer to {target_version}")
        self._pending, self._pending_target = {}, target_version

    def stage(self, key: str, positions: torch.Tensor, new: torch.Tensor, *,
              on_device: tuple[torch.Tensor, torch.Tensor] | None = None,
              coordinates: DiffCoordinates | None = None) -> None:
        """Remember changed positions (relative to the range) and their new bits;
        `on_device`: the same two already on a GPU, for the range's device mirror.
        `coordinates`: `positions` are in the canonical coordinates the producer's diff
        wrote (`diff.DiffCoordinates`), mapped back to the range's at the commit, in its
        background update, off the refit's critical path."""
        if self._pending is None:
            raise RuntimeError("stage() outside a transfer: call begin() first")
        p = self._pending.setdefault(key, _Pending())
        mirror = self._mirrors.get(key)
        if mirror is not None and on_device is not None and on_device[0].device == mirror.device:
            p.on_device.append(on_device)  # commit updates the mirror without a host round trip
        p.positions.append(positions.cpu())
        p.new.append(new.cpu())
        p.coordinates.append(coordinates)

    def commit(self) -> int:
        """Make the pending transfer's bits the committed baseline (joint commit).

        Returns once the version has moved on; the scatter (and, file-backed, the sync of
        the range files) runs in the background, off the refit's critical path, since
        what receivers serve no longer depends on it. Everything that reads the committed
        bits (`committed`, `begin`, `abort`) waits for it first: `wait_committed`."""
        if self._pending is None:
            raise RuntimeError("commit() without a transfer in flight")
        pending = self._pending
        for key, p in pending.items():  # device mirrors first, on the caller's stream: cheap
            if key not in self._mirrors or not p.positions:
                continue
            if len(p.on_device) == len(p.positions):
                self._mirrors[key][torch.cat([pos for pos, _ in p.on_device])] = torch.cat([n for _, n in p.on_device])
            else:  # diffed elsewhere this time (weights offloaded to the host): rebuilt on next use
                del self._mirrors[key]
        self.version = self._pending_target
        self._pending = self._pending_target = None
        self._updating = threading.Thread(target=self._update, args=(pending,), name="nemo-dcr-baseline-commit")
        self._updating.start()
        return self.version

    def _update(self, pending: dict[str, _Pending]) -> None:
        """Scatter the committed changes in; file-backed: then sync the range files, advance
        the manifest and drop the journal, so a crash at any point leaves the journal
        (replayed on restore) or the finished state. (torch's scatter and os.fsync release
        the GIL; an mmap flush would not.)"""
        try:
            for key, (positions, new) in _merged(pending).items():
                self._committed[key][positions] = new
            if self.directory is not None:
                for key in self._maps:
                    fd = os.open(self._path(key), os.O_RDWR)  # on Linux this also writes back
                    try:                                       # the pages the mapping dirtied
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                self._write_manifest()
                shutil.rmtree(os.path.join(self.directory, JOURNAL), ignore_errors=True)
        except BaseException as exc:  # noqa: BLE001 - reported by wait_committed()
            self._update_error = exc

    def wait_committed(self) -> None:
        """Wait until the last commit's bits are in the baseline (and on disk, when
        file-backed); raise if that failed (a file-backed journal is kept for restart)."""
        if self._updating is not None:
            self._updating.join()
            self._updating = None
        if self._update_error is not None:
            exc, self._update_error = self._update_error, None
            kept = (f" in {self.directory}; its journal is kept and is replayed on restart"
                    if self.directory is not None else "")
            raise OSError(f"baseline update to version {self.version} failed ({type(exc).__name__}: {exc})"
                          f"{kept}") from exc

    def abort(self) -> None:
        """Drop the pending transfer; the committed version stays as it was."""
        self.wait_committed()
        self._pending = self._pending_target = None
        if self.directory is not None:
            shutil.rmtree(os.path.join(self.directory, JOURNAL), ignore_errors=True)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    # --- durability (file-backed only) ---------------------------------------------

    def seal(self) -> None:
        """Write the manifest for the ranges registered so far (call once set-up is done)."""
        if self.directory is not None:
            self._write_manifest()

    def persist_pending(self) -> None:
        """Make the transfer's changes durable before its commit record can exist.

        Written to `journal.tmp/` and renamed into place, so a journal is whole or absent.
        """
        if self.directory is None or self._pending is None:
            return
        tmp = os.path.join(self.directory, JOURNAL + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        entries = []
        for i, (key, (positions, new)) in enumerate(sorted(_merged(self._pending).items())):
            np.save(os.path.join(tmp, f"{i}.pos.npy"), positions.numpy())
            np.save(os.path.join(tmp, f"{i}.new.npy"), new.numpy())
            entries.append({"key": key, "index": i})
        _write_json(os.path.join(tmp, "journal.json"), {"target": self._pending_target, "entries": entries})
        final = os.path.join(self.directory, JOURNAL)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, _file_name(key))

    def _write_manifest(self) -> None:
        ranges = {k: {"file": _file_name(k), "dtype": str(t.dtype).removeprefix("torch."), "numel": t.numel()}
                  for k, t in self._committed.items()}
        _write_json(os.path.join(self.directory, MANIFEST),
                    {"version": self.version, "fingerprint": self.fingerprint, "ranges": ranges})

    def _restore(self) -> None:
        manifest = _read_json(os.path.join(self.directory, MANIFEST))
        journal_dir = os.path.join(self.directory, JOURNAL)
        journal = _read_json(os.path.join(journal_dir, "journal.json"))
        shutil.rmtree(journal_dir + ".tmp", ignore_errors=True)  # a journal that was never whole
        if manifest is None:
            self.restore_note = "no baseline manifest in the directory"
            shutil.rmtree(journal_dir, ignore_errors=True)
            return
        problem = None
        if manifest.get("fingerprint") != self.fingerprint:
            problem = "it was written for another layout, ownership or checkpoint (fingerprint differs)"
        elif journal is not None and journal.get("target") == self.version == manifest.get("version", -1) + 1:
            pass  # committed, but the crash came before the manifest moved on: replayed below
        elif manifest.get("version") != self.version:
            problem = f"it holds version {manifest.get('version')}, the commit log says {self.version}"
        if problem is not None:
            self.restore_note = f"baseline in {self.directory} not restored: {problem}"
            log.warning(self.restore_note)
            shutil.rmtree(journal_dir, ignore_errors=True)
            return
        try:
            for key, r in manifest["ranges"].items():
                dtype = getattr(torch, r["dtype"])
                mm = np.memmap(os.path.join(self.directory, r["file"]), dtype=_np_dtype(dtype), mode="r+",
                               shape=(int(r["numel"]),))
                self._maps[key] = mm
                self._committed[key] = torch.from_numpy(mm)
            if journal is not None and journal.get("target") == self.version:
                for e in journal["entries"]:
                    pos = np.load(os.path.join(journal_dir, f"{e['index']}.pos.npy"), allow_pickle=False)
                    new = np.load(os.path.join(journal_dir, f"{e['index']}.new.npy"), allow_pickle=False)
                    self._committed[e["key"]][torch.from_numpy(pos)] = torch.from_numpy(new)
                for mm in self._maps.values():
                    mm.flush()
                self._write_manifest()
        except (OSError, KeyError, ValueError, AttributeError) as exc:
            self._committed, self._maps = {}, {}
            self.restore_note = f"baseline in {self.directory} not restored: unreadable ({exc})"
            log.warning(self.restore_note)
            return
        finally:
            shutil.rmtree(journal_dir, ignore_errors=True)
        self.restored = True
        self.restore_note = f"baseline version {self.version} restored from {self.directory}"


def _merged(pending: dict[str, _Pending]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each range's staged changes as one (positions, new bits) pair."""
    return {key: (p.local_positions(), torch.cat(p.new)) for key, p in pending.items() if p.positions}


def fingerprint(*parts) -> str:
    """A stable digest of what a baseline was registered for (layout, ranges, checkpoint)."""
    return hashlib.blake2b(json.dumps(parts, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    width = torch.empty((), dtype=dtype).element_size()
    return np.dtype(np.uint8) if dtype == torch.uint8 else np.dtype(f"<i{width}")


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        log.warning("unreadable %s: %s", path, exc)
        return None


def _file_name(key: str) -> str:
    # Readable and collision-free: sanitised key plus a short hash of the exact key.
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in key)[:120]
    return f"{safe}-{hashlib.blake2b(key.encode(), digest_size=6).hexdigest()}.bits"
