"""The rollout side of the checkpoint engine: a receiver over a canonical mirror.

NeMo RL's plug-in interface gives a vLLM worker's engine no handle on the model: it
yields `(name, tensor)` batches and vLLM loads each one with its own `load_weights`
(not transactional). So each vLLM worker keeps a canonical mirror of the weights it
serves (`TensorStoreRuntime`, host memory, one model in checkpoint dtype), the
receiver applies the changed bits to the mirror, and only after the joint commit are
the tensors the transfer touched yielded to vLLM. A transfer that does not commit is
reverted in the mirror and nothing is yielded: vLLM keeps serving version v, and the
update raises.

The mirror is built from the catalog the trainer's rank 0 announces before each
transfer; it starts at zeros, marked as holding no version, so the first refit resyncs
it densely (all tensors are yielded then: this also covers vLLM's
`load_format="dummy"` start).

The mirror is a tensor store in canonical layout, so with `conditioned: true` the
receiver decodes baseline-conditioned records against it in place: no second copy (unlike
the shard-local tier's `nemo_dcr.mirror.CanonicalMirror`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch

from nemo_dcr import dtypes
from nemo_dcr.control_auth import ReplayGuard, check
from nemo_dcr.integrations.nemo_rl.config import DCRRefitConfig
from nemo_dcr.integrations.nemo_rl.transfer_wait import UpdateFailed, finish_transfer
from nemo_dcr.runtimes.base import UndoLog
from nemo_dcr.runtimes.store import TensorStoreRuntime

log = logging.getLogger("nemo_dcr.nemo_rl")


class MirrorRuntime(TensorStoreRuntime):
    """A canonical tensor store that remembers which tensors were written."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.touched: set[str] = set()

    def apply(self, records) -> UndoLog:
        records = list(records)
        undo = super().apply(records)
        self.touched.update(r.name for r in records if len(r))
        return undo


def zeros_mirror(catalog: dict) -> MirrorRuntime:
    """A mirror of `catalog` (name -> [dtype, shape]) filled with zeros."""
    tensors = {}
    for name, (dtype, shape) in catalog.items():
        tensors[name] = torch.zeros(tuple(int(s) for s in shape), dtype=dtypes.from_name(dtype).torch_dtype)
    return MirrorRuntime(tensors)


def batches(names: list[str], tensors: dict, max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`(name, tensor)` lists of at most `max_bytes` each (a larger tensor goes alone)."""
    batch, size = [], 0
    for name in names:
        tensor = tensors[name]
        if batch and size + tensor.nbytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append((name, tensor))
        size += tensor.nbytes
    if batch:
        yield batch


class MirrorReceiver:
    """One vLLM worker's receiver (id `rollout<rank>`), kept across refits."""

    def __init__(self, settings: DCRRefitConfig, receiver_id: str, transport):
        self.settings, self.id = settings, receiver_id
        self.key = settings.key()
        self.end = transport.receiver(receiver_id)
        self.receiver = None  # built from the first catalog
        self.guard = ReplayGuard()  # the trainer's session, for catalogs and (shared) the receiver's messages
        self.reload_all = False  # vLLM may hold a mix of versions: load every tensor next time
        self.last: dict = {}

    # -- one update ------------------------------------------------------------------

    def update(self, max_batch_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Take the next transfer to its end; on commit, yield the tensors it changed in
        batches of at most `max_batch_bytes` (one tensor may exceed it). Raises
        UpdateFailed when it aborted or nothing was decided within `timeout_s`."""
        t0 = time.perf_counter()
        version = self.receiver.serving_version if self.receiver is not None else None
        done = self._run_transfer()
        rx = self.receiver
        runtime = rx.runtime
        names = list(runtime.tensors) if self.reload_all else [n for n in runtime.tensors if n in runtime.touched]
        runtime.touched.clear()
        self.last = {"version": rx.serving_version, "previous_version": version, "tensors": len(names),
                     "resyncs": rx.resyncs, "stage_s": done.stage_s, "apply_s": done.apply_s}
        self.reload_all = True  # until every batch was taken: a load cut short leaves vLLM mixed
        t_load = time.perf_counter()  # between yields, vLLM loads what it was given
        for batch in batches(names, runtime.tensors, max_batch_bytes):
            yield batch
        self.reload_all = False
        self.last.update(load_s=time.perf_counter() - t_load, update_s=time.perf_counter() - t0)

    def _run_transfer(self):
        try:
            return finish_transfer(lambda: self.receiver, self.end, self.id, self.settings.timeout_s, self._on_catalog)
        except UpdateFailed:
            self._forget_touched()
            raise

    def _forget_touched(self) -> None:
        # What a failed transfer wrote was reverted: vLLM already holds those tensors.
        if self.receiver is not None:
            self.receiver.runtime.touched.clear()

    def _on_catalog(self, event) -> None:
        meta = event.meta
        try:
            why = check(self.key, "catalog", meta)
            if why is None and self.key is not None:
                why = self.guard.problem("catalog", meta, time.time())
            if why is not None:
                log.warning("[%s] ignored a catalog: %s", self.id, why)
                return
            catalog = meta.get("catalog")
            if not isinstance(catalog, dict) or not catalog:
                log.warning("[%s] ignored a malformed catalog", self.id)
                return
            if self.receiver is not None:
                held = {n: [d, list(s)] for n, (d, s) in self.receiver.runtime.catalog().items()}
                if held != catalog:
                    log.error("[%s] the trainer's tensors changed (%d now, %d held): rebuilding the mirror; "
                              "the next transfer resyncs it densely", self.id, len(catalog), len(held))
                    self._build(catalog, int(meta.get("version", 0)))
                return
            self._build(catalog, int(meta.get("version", 0)))
        finally:
            event.release()

    def _build(self, catalog: dict, version: int) -> None:
        from nemo_dcr.receiver import Receiver

        try:
            runtime = zeros_mirror(catalog)
        except (KeyError, ValueError, TypeError) as e:
            log.error("[%s] cannot build a mirror from the catalog: %s", self.id, e)
            return
        self.receiver = Receiver(self.id, runtime, self.end, version=version, key=self.key,
                                 state_digest=self.settings.state_digest, log=log.info)
        self.receiver.guard = self.guard  # one memory of the trainer's sessions, catalogs included
        # Zeros are no version: the first transfer's begin asks for a dense resync.
        self.receiver.uncertain_state = "its canonical mirror was just built and holds no version yet"
        self.reload_all = True
        log.info("[%s] canonical mirror of %d tensors (%.1f MiB) built", self.id, len(catalog),
                 sum(t.nbytes for t in runtime.tensors.values()) / 2**20)

    def close(self) -> None:
        self.end.close()
