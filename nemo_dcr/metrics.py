"""Refit metrics for Prometheus: every number of `RefitResult.metrics()` as a gauge
(and `page_faults`, the process counter producers and receivers report in them).

NeMo RL's logger takes the flat dict directly; a deployment that scrapes Prometheus
starts an exporter once on the trainer's rank 0 and hands it each result:

    exporter = PrometheusExporter(port=9464)          # http://<host>:9464/metrics
    result = refit.refit()
    exporter.observe(result.metrics())

Gauges are named `nemo_dcr_<key>` (e.g. `nemo_dcr_wire_bytes`, `nemo_dcr_pause_s`);
counters `nemo_dcr_refits_total` and `nemo_dcr_refits_failed_total` count outcomes.
Needs the `prometheus_client` package (`pip install nemo-dcr[metrics]`).
"""

from __future__ import annotations

import re
import resource
import warnings


def page_faults() -> int:
    """Minor page faults of this process so far (first touches of memory). Producers and
    receivers report how many a refit took: on a VM each costs about a microsecond, and a
    refit that touches fresh memory for its changes pays it per page, every refit."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class PrometheusExporter:
    """Serves the latest refit's metrics over HTTP (or only holds them, with port=None)."""

    def __init__(self, port: int | None = 9464, addr: str = "127.0.0.1", registry=None):
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise ImportError("PrometheusExporter needs prometheus_client: pip install nemo-dcr[metrics]") from exc
        self._prom = prom
        self.registry = registry or prom.CollectorRegistry()
        self._gauges: dict[str, object] = {}
        self.refits = prom.Counter("nemo_dcr_refits", "Refits attempted", registry=self.registry)
        self.failed = prom.Counter("nemo_dcr_refits_failed", "Refits that did not commit", registry=self.registry)
        self.server = None
        if port is not None:
            if addr not in ("127.0.0.1", "localhost", "::1"):
                warnings.warn(f"the metrics endpoint on {addr}:{port} has no authentication: anyone who reaches "
                              f"it reads the refit metrics", stacklevel=2)
            self.server, self.thread = prom.start_http_server(port, addr=addr, registry=self.registry)

    def observe(self, metrics: dict) -> None:
        """Record one refit's `RefitResult.metrics()` (booleans as 0/1, non-numbers skipped)."""
        self.refits.inc()
        if metrics.get("committed") is False:
            self.failed.inc()
        for key, value in metrics.items():
            if isinstance(value, bool):
                value = int(value)
            if not isinstance(value, (int, float)):
                continue
            name = "nemo_dcr_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = self._gauges[name] = self._prom.Gauge(name, f"last refit: {key}", registry=self.registry)
            gauge.set(value)

    def observe_failure(self) -> None:
        """A refit that raised before producing metrics (TransferFailed)."""
        self.refits.inc()
        self.failed.inc()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
