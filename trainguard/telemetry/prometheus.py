"""The node's ``/metrics`` endpoint: an OpenTelemetry ``MetricReader`` served by prometheus_client.

Scrapes collect from the OpenTelemetry SDK on demand (pull), so Prometheus and OTLP see the
same numbers. Names and help texts come from the metric contract.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    MetricReader,
    MetricsData,
    Sum,
)
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric

from trainguard.core.atomicfile import write_atomic
from trainguard.core.contracts.metrics import by_name, prometheus_name
from trainguard.core.contracts.rundir import RunDir

__all__ = ["PrometheusBridge", "PrometheusEndpoint", "endpoint_file"]

logger = logging.getLogger(__name__)


def _prom_name(otel_name: str, unit: str, kind: str) -> str:
    try:
        return by_name(otel_name).prometheus
    except KeyError:
        from trainguard.core.contracts.metrics import MetricSpec

        return prometheus_name(MetricSpec(name=otel_name, unit=unit, kind=kind, description=""))  # type: ignore[arg-type]


def _fmt_le(bound: float) -> str:
    return repr(float(bound))


class PrometheusBridge(MetricReader):
    """A pull ``MetricReader``; ``families()`` yields prometheus_client metric families.

    ``MetricReader.collect`` stays the SDK's (``MeterProvider.force_flush`` calls it with
    ``timeout_millis``); prometheus_client scrapes through ``_Collector``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._data: MetricsData | None = None

    def _receive_metrics(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object
    ) -> None:
        self._data = metrics_data

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        self._data = None

    def families(self) -> Iterator[Metric]:
        """Collect from the SDK now and yield what it gave as metric families."""
        try:
            self.collect()
        except Exception:
            logger.exception("collecting metrics for a scrape failed")
            return
        data = self._data
        if data is None:
            return
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    fam = self._family(m)
                    if fam is not None:
                        yield fam

    @staticmethod
    def _family(m: Any) -> Metric | None:
        d = m.data
        if isinstance(d, Sum):
            kind = "counter" if d.is_monotonic else "gauge"
        elif isinstance(d, Gauge):
            kind = "gauge"
        elif isinstance(d, Histogram):
            kind = "histogram"
        else:
            return None
        name = _prom_name(m.name, m.unit or "", kind)
        base = name[: -len("_total")] if kind == "counter" and name.endswith("_total") else name
        fam = Metric(base, m.description or m.name, kind)
        for p in d.data_points:
            labels = {str(k): str(v) for k, v in (p.attributes or {}).items()}
            if kind == "histogram":
                cum = 0
                for bound, count in zip(p.explicit_bounds, p.bucket_counts, strict=False):
                    cum += count
                    fam.add_sample(base + "_bucket", {**labels, "le": _fmt_le(bound)}, cum)
                fam.add_sample(base + "_bucket", {**labels, "le": "+Inf"}, p.count)
                fam.add_sample(base + "_count", labels, p.count)
                fam.add_sample(base + "_sum", labels, p.sum)
            elif kind == "counter":
                fam.add_sample(base + "_total", labels, p.value)
            else:
                fam.add_sample(base, labels, p.value)
        return fam


class _Collector:
    """prometheus_client's Collector protocol over a bridge."""

    def __init__(self, bridge: PrometheusBridge) -> None:
        self.bridge = bridge

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        return self.bridge.families()


def endpoint_file(run_dir: str | os.PathLike[str], node: str) -> Path:
    """Where the agent of ``node`` writes ``{"host", "port", "url", "pid"}``."""
    return RunDir(run_dir).prometheus_endpoint(node)


class PrometheusEndpoint:
    """Serves a bridge on ``host:port``; a taken port falls back to a free one (logged)."""

    def __init__(self, bridge: PrometheusBridge, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(bridge))
        self.host = host
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            logger.warning("metrics port %s:%d unavailable (%s); using a free port", host, port, e)
            self._server, self._thread = start_http_server(0, addr=host, registry=self.registry)
        self.port = int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def write(self, path: Path) -> None:
        info = {"host": self.host, "port": self.port, "url": self.url, "pid": os.getpid()}
        write_atomic(path, json.dumps(info) + "\n")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
