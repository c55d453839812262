"""The policy side of the checkpoint engine: disjoint shares of the exported tensors.

NeMo RL hands every policy rank the same stream of full Hugging Face tensors (its
Megatron worker gathers each one across TP/PP/EP while the stream is read, so every
rank must read the stream to its end). Each rank keeps only its share of every tensor:
the contiguous chunk `even_split(numel, rank, world)` of its flat elements, so the
shares of all ranks partition the model and no change is sent twice. The shares are
the owned ranges of a `TrainerRefit` over canonical names (the identity converter): it
diffs each share against its committed baseline and sends only the changed bits.

Memory per rank: two copies of its share (the live share and its baseline), each
1/world of the model.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from nemo_dcr import dtypes
from nemo_dcr.capture import even_split
from nemo_dcr.errors import TransferFailed
from nemo_dcr.integrations.nemo_rl.config import DCRRefitConfig
from nemo_dcr.layout import LocalParam, OwnedRange, ParallelLayout

log = logging.getLogger("nemo_dcr.nemo_rl")


def rollout_receiver_ids(rollout_world_size: int) -> list[str]:
    """The receiver id of every vLLM worker (global rollout rank r: `rollout<r>`)."""
    return [f"rollout{r}" for r in range(rollout_world_size)]


class ExportShares:
    """This rank's share of every exported tensor, kept (and refreshed) across refits."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.specs: dict[str, tuple[str, tuple[int, ...]]] = {}  # canonical catalog, in stream order
        self.buffers: dict[str, torch.Tensor] = {}  # name -> this rank's flat chunk (may be empty)
        self.bounds: dict[str, tuple[int, int]] = {}
        self.read_bytes = 0  # what the last `absorb` copied out of the stream
        self.stream_bytes = 0  # ... and what the stream held (every tensor, whole)

    def absorb(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Read the whole stream, copying this rank's chunk of each tensor. The stream is
        always read to its end (it runs collectives on every rank), also when a tensor is
        refused; the problems are raised afterwards, all of them."""
        first = not self.specs
        seen: set[str] = set()
        problems: list[str] = []
        self.read_bytes = self.stream_bytes = 0
        for name, tensor in weights:
            try:
                self._take(name, tensor, first)
            except (ValueError, TypeError) as e:
                problems.append(str(e))
            seen.add(name)
        missing = sorted(set(self.specs) - seen)
        if missing and not first:
            problems.append(f"the export no longer holds {len(missing)} tensor(s) it held at the first refit, "
                            f"e.g. {missing[:3]}")
        if first and not self.specs and not problems:
            problems.append("the policy's weight iterator yielded no tensors")
        if problems:
            if first:  # nothing half-established: the next refit starts over
                self.specs, self.buffers, self.bounds = {}, {}, {}
            raise ValueError(f"policy rank {self.rank}: " + "; ".join(problems[:5]))

    def _take(self, name: str, tensor: torch.Tensor, first: bool) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r}: expected a tensor, got {type(tensor).__name__}")
        try:
            dtype = dtypes.from_torch(tensor.dtype).name
        except ValueError as e:
            raise ValueError(f"{name!r}: {e}") from None
        spec = (dtype, tuple(int(s) for s in tensor.shape))
        if first:
            if name in self.specs:
                raise ValueError(f"{name!r} appears twice in the export")
            start, stop = even_split(tensor.numel(), self.rank, self.world)
            self.specs[name] = spec
            self.bounds[name] = (start, stop)
            self.buffers[name] = torch.empty(stop - start, dtype=tensor.dtype, device=tensor.device)
        elif self.specs.get(name) != spec:
            raise ValueError(f"{name!r} is {spec[0]} {spec[1]} now, {self.specs.get(name, 'absent')} at the first "
                             f"refit: the model's shapes cannot change between refits")
        start, stop = self.bounds[name]
        self.stream_bytes += tensor.numel() * tensor.element_size()
        if stop > start:
            self.buffers[name].copy_(tensor.detach().reshape(-1)[start:stop])
            self.read_bytes += (stop - start) * tensor.element_size()

    def owned_ranges(self) -> list[OwnedRange]:
        out = []
        for name, (dtype, shape) in self.specs.items():
            start, stop = self.bounds[name]
            if stop > start:
                local = LocalParam(name=name, local_shape=shape, dtype=dtypes.from_name(dtype).torch_dtype)
                out.append(OwnedRange(param=local, start=start, stop=stop, tensor=self.buffers[name]))
        return out


def ensure_process_group(world: int) -> None:
    """The default process group the refit's collectives run on: NeMo RL's, which spans
    the policy ranks; a single policy rank without one gets a local one."""
    from nemo_dcr.trainer import ensure_process_group as default_group

    if dist.is_initialized() and dist.get_world_size() != world:
        raise RuntimeError(f"NeMo-DCR: torch.distributed spans {dist.get_world_size()} ranks, but NeMo RL "
                           f"reports {world} policy ranks: the refit's collectives need exactly the policy ranks")
    if not dist.is_initialized() and world != 1:
        raise RuntimeError(f"NeMo-DCR: {world} policy ranks but torch.distributed is not initialized in this worker")
    default_group()


def commit_state_dir(settings: DCRRefitConfig, rank: int) -> str:
    """Where rank 0 keeps the commit records: the configured folder, else a fresh one per
    run (a new lineage; its first refit is dense anyway). The s3 transport keeps them in
    its bucket, and only rank 0 writes any."""
    if settings.state_dir is not None:
        return settings.state_dir
    return "" if settings.transport == "s3" or rank != 0 else tempfile.mkdtemp(prefix="nemo-dcr-commits-")


def refit_once(trainer_refit, number: int) -> dict:
    """One refit of `trainer_refit` (collective); its numeric metrics.
    A refit that did not commit is logged and raised (TransferFailed)."""
    try:
        result = trainer_refit.refit()
    except TransferFailed:
        log.error("NeMo-DCR refit %d failed: nothing committed, every vLLM worker keeps serving version %d",
                  number, trainer_refit.baseline.version)
        raise
    metrics = {k: float(v) for k, v in result.metrics().items() if isinstance(v, (int, float))}
    if trainer_refit.rank == 0:
        log.info("refit to version %d: %d changed elements, %d wire bytes, %d receiver(s) resynced densely, "
                 "%.2f s", result.decision.version, result.changed_elements, result.wire_bytes,
                 len(result.resynced), result.seconds)
    return metrics


class SharedExportRefit:
    """One policy rank's refit over its shares (built at the first refit)."""

    def __init__(self, settings: DCRRefitConfig, rank: int, world: int, receivers: list[str]):
        self.settings, self.receivers = settings, receivers
        self.shares = ExportShares(rank, world)
        self.refit = None
        self.transport = None
        self.refits = 0

    def _build(self) -> None:
        from nemo_dcr import registry
        from nemo_dcr.trainer import TrainerRefit

        s = self.settings
        state_dir = commit_state_dir(s, self.shares.rank)
        self.transport = s.build_transport(self.receivers)
        self.refit = TrainerRefit(
            registry.converter("identity", None), dict(self.shares.specs), self.shares.owned_ranges(),
            ParallelLayout(dp_size=self.shares.world, dp_rank=self.shares.rank), self.transport,
            state_dir=state_dir, op=s.op, key=s.key(), timeout_s=s.timeout_s,
            max_payload_elements=s.max_payload_elements, encode_threads=s.encode_threads,
            wire_version=s.wire_version, max_attempts=s.max_attempts, state_digest=s.state_digest,
            conditioned=s.conditioned, log=log.warning)

    def _absorb(self, weights: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Collective: read the stream into the shares (seconds taken); ValueError on
        every rank when any rank refused it."""
        from nemo_dcr.trainer import bcast_json, gather_json

        t0 = time.perf_counter()
        problem = None
        try:
            self.shares.absorb(weights)
        except ValueError as e:
            problem = str(e)
        problems = bcast_json([p for p in gather_json(problem) or [] if p])
        if problems:
            raise ValueError("NeMo-DCR: the exported weights cannot be refit: " + "; ".join(problems))
        return time.perf_counter() - t0

    def establish(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Collective: take these weights as the committed version the receivers hold
        (their digests are checked at the first refit; any that differ are resynced)."""
        self._absorb(weights)
        self._build()

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Collective over the policy ranks: read the export, then one refit. Returns the
        refit's metrics (complete on rank 0); raises TransferFailed when it did not commit,
        and ValueError (on every rank) when the export cannot be refit."""
        export_s = self._absorb(weights)
        if self.refit is None:
            self._build()
        if self.refit.coordinator is not None:  # receivers build their canonical mirror from it
            self.refit.coordinator.announce_catalog(self.shares.specs)
        self.refits += 1
        metrics = refit_once(self.refit, self.refits)
        metrics.update(export_read_s=export_s, export_read_bytes=float(self.shares.read_bytes),
                       export_stream_bytes=float(self.shares.stream_bytes))
        return metrics

    def close(self, shutdown_receivers: bool = False) -> None:
        if self.refit is not None:
            self.refit.close(shutdown_receivers=shutdown_receivers)
            self.refit = None
