"""The trainer side of NeMo-DCR inside NeMo RL's Megatron policy worker.

NeMo RL runs one policy worker (a Ray actor) per Megatron rank; each holds its model
chunks (`self.model`) and the Megatron optimizer (`self.optimizer`). With
`policy.generation.refit_transport: dcr`, every worker builds a `DCRPolicyRefit` once,
after the model holds the weights the rollout engines were started from (version 0),
and calls `stream_weights_via_dcr()` where NeMo RL would call
`broadcast_weights_for_collective()`:

    settings = from_generation_config(cfg["policy"]["generation"])      # validated once
    self.dcr = DCRPolicyRefit.from_megatron_worker(
        settings, self.model, self.optimizer, hf_config, hf_checkpoint_dir, layout,
        receivers=receiver_ids("vllm", dp_size=2, tp_size=4))
    ...
    ok = self.dcr.stream_weights_via_dcr()     # every rank, collectively
    metrics = self.dcr.last_metrics             # flat dict for NeMo RL's logger (rank 0: all numbers)

`stream_weights_via_dcr` runs one refit (begin -> stream the changed elements while
later ranges are still being diffed -> flush -> joint commit) and returns True when
version v+1 committed on every receiver and every producer, False when the transfer did
not commit (the reason is logged and kept in `last_error`; receivers still serve v and
the baselines stay at v, so the next refit resends everything since v). With
`verify: every_refit`, a committed refit is followed by the receivers' digests; a
receiver that does not serve the committed version, or whose digests differ from
`expected_digests()` when one is given, raises `RefitVerifyError` on every rank: the
engines then serve weights the trainer does not hold, which no retry fixes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch.distributed as dist

from nemo_dcr.errors import TransferFailed
from nemo_dcr.integrations.nemo_rl.config import DCRSettings

log = logging.getLogger("nemo_dcr.nemo_rl")


class RefitVerifyError(RuntimeError):
    """A committed refit whose receivers do not hold what the trainer holds."""


def receiver_ids(prefix: str = "vllm", dp_size: int = 1, tp_size: int = 1) -> list[str]:
    """The receiver ids of `dp_size` vLLM engines of `tp_size` workers each, as
    `nemo_dcr.integrations.nemo_rl.generation.start_dcr_receivers` names them
    (engine i: `<prefix><i>`, and under TP its workers `<prefix><i>-tp<rank>`)."""
    if tp_size == 1:
        return [f"{prefix}{i}" for i in range(dp_size)]
    return [f"{prefix}{i}-tp{r}" for i in range(dp_size) for r in range(tp_size)]


class DCRPolicyRefit:
    """One rank's refit handle (a `TrainerRefit`), NeMo RL-shaped.

    expected_digests: optional collective callable (every rank calls it) returning, on
    rank 0, the BLAKE2b digests of the dense canonical weights (`nemo_dcr.verify.
    state_digests` of an HF export); used by `verify: every_refit`. Without it, verify
    checks only that every receiver answers and serves the committed version.
    exporter: a `nemo_dcr.metrics.PrometheusExporter` (rank 0) fed after every refit.
    """

    def __init__(self, settings: DCRSettings, refit, *, exporter=None,
                 expected_digests: Callable[[], dict | None] | None = None, logger: logging.Logger | None = None):
        self.settings = settings
        self.refit = refit
        self.transport = None  # set by from_megatron_worker (for cleanup())
        self.exporter = exporter
        self.expected_digests = expected_digests
        self.log = logger or log
        self.rank = dist.get_rank()
        self.last_metrics: dict[str, float | int] = {}
        self.last_error: str | None = None
        self.last_result = None
        self.refits = 0
        self.failed = 0

    @classmethod
    def from_megatron_worker(cls, settings: DCRSettings, model_chunks, optimizer, hf_config, checkpoint_dir,
                             layout, *, receivers: list[str], expected_digests=None, logger=None,
                             assume_committed: bool = False) -> DCRPolicyRefit:
        """Collective (every rank of the training job): build the converter, transport and
        producers for this rank's owned ranges of the distributed optimizer.

        checkpoint_dir: the Hugging Face checkpoint the receivers were loaded from (its
        safetensors headers are the canonical catalog). layout: this rank's
        `nemo_dcr.layout.ParallelLayout`. receivers: every receiver id (`receiver_ids`).
        """
        from nemo_dcr import registry
        from nemo_dcr.capture import megatron_owned_ranges
        from nemo_dcr.checkpoint import read_specs
        from nemo_dcr.trainer import TrainerRefit

        model_chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        converter = registry.converter(settings.converter_name(hf_config), hf_config, **settings.converter_options)
        specs = read_specs(checkpoint_dir)
        owned = megatron_owned_ranges(optimizer, list(model_chunks))
        transport = settings.build_transport(list(receivers))
        kwargs = settings.trainer_kwargs()
        if kwargs["state_dir"] is None:  # the s3 transport keeps its commit records in the bucket
            kwargs["state_dir"] = ""
        refit = TrainerRefit(converter, specs, owned, layout, transport, assume_committed=assume_committed,
                             **kwargs)
        exporter = None
        if settings.metrics_port is not None and dist.get_rank() == 0:
            from nemo_dcr.metrics import PrometheusExporter

            exporter = PrometheusExporter(port=settings.metrics_port)
        out = cls(settings, refit, exporter=exporter, expected_digests=expected_digests, logger=logger)
        out.transport = transport
        return out

    @property
    def version(self) -> int:
        """The committed version (what receivers serve and the baselines hold)."""
        return self.refit.baseline.version

    def stream_weights_via_dcr(self) -> bool:
        """Collective: one refit. True when version v+1 committed everywhere, False when
        nothing was committed (reason in `last_error`); `last_metrics` holds the numbers."""
        t0 = time.perf_counter()
        self.refits += 1
        self.last_error = None
        try:
            result = self.refit.refit()
        except TransferFailed as exc:
            self.failed += 1
            self.last_result = None
            self.last_error = str(exc)
            self.log.error("NeMo-DCR refit failed, nothing committed (receivers keep serving version %d): %s",
                           self.version, exc)
            self._abort_in_flight(str(exc))
            self.last_metrics = {"version": self.version, "committed": 0, "refit_s": time.perf_counter() - t0,
                                 "refits": self.refits, "refits_failed": self.failed}
            if self.exporter is not None:
                self.exporter.observe_failure()
            return False
        self.last_result = result
        metrics = {k: int(v) if isinstance(v, bool) else v for k, v in result.metrics().items()}
        if self.settings.verify == "every_refit":
            metrics.update(self._verify(result.decision.version))
        if self.exporter is not None:
            self.exporter.observe(metrics)  # it counts refits itself (nemo_dcr_refits_total)
        self.last_metrics = {**metrics, "refits": self.refits, "refits_failed": self.failed}
        return True

    def _abort_in_flight(self, reason: str) -> None:
        """Rank 0: tell every receiver the transfer is over, also when it failed before the
        coordinator could abort it (a receiver not ready at begin): receivers waiting for
        it return at once instead of at their timeout. A second abort is ignored."""
        if self.refit.coordinator is None or self.refit.transfer is None:
            return
        try:
            self.refit.coordinator.abort(self.refit.transfer, reason)
        except Exception as exc:  # noqa: BLE001 - best effort: receivers also time out
            self.log.warning("could not broadcast the abort: %s", exc)

    def _verify(self, version: int) -> dict:
        """Collective: the receivers' digests against `expected_digests()` (if given)."""
        from nemo_dcr.trainer import bcast_json
        from nemo_dcr.verify import compare_digests

        t = time.perf_counter()
        expected = self.expected_digests() if self.expected_digests is not None else None
        problems: list[str] = []
        checked = 0
        if self.rank == 0:
            try:
                replies = self.refit.coordinator.verify()
            except Exception as exc:  # noqa: BLE001 - a receiver that does not answer is a failed check
                replies, problems = {}, [f"verify: {type(exc).__name__}: {exc}"]
            for rx, reply in sorted(replies.items()):
                if reply.get("version") != version:
                    problems.append(f"{rx} serves version {reply.get('version')}, committed {version}")
                if expected is not None:
                    bad = compare_digests(expected, reply.get("digests") or {})
                    checked += 1
                    if bad:
                        problems.append(f"{rx}: {len(bad)} tensor(s) differ from the trainer: {bad[:3]}")
        problems = bcast_json(problems)
        if problems:
            self.failed += 1
            message = (f"NeMo-DCR: version {version} committed but the receivers do not hold the trainer's "
                       f"weights: " + "; ".join(problems[:5]))
            self.log.error(message)
            if self.exporter is not None:
                self.exporter.observe_failure()
            raise RefitVerifyError(message)
        return {"verify_s": time.perf_counter() - t, "verified_receivers": checked}

    def close(self, shutdown_receivers: bool = False) -> None:
        self.refit.close(shutdown_receivers=shutdown_receivers)
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
