"""Exporters of the node agent: JSONL files (always on), OTLP (when configured), and wrappers
that count failures instead of raising (telemetry never takes down training)."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from trainguard.core.atomicfile import open_append

__all__ = [
    "CountingMetricExporter",
    "CountingSpanExporter",
    "JsonlMetricExporter",
    "JsonlSpanExporter",
    "build_otlp_exporters",
    "resolve_otlp",
]

logger = logging.getLogger(__name__)

OnFailure = Callable[[str], None]


class CountingSpanExporter(SpanExporter):
    """Delegates to ``inner``; a failure or exception is logged (rate-limited) and counted."""

    def __init__(self, inner: SpanExporter, name: str, on_failure: OnFailure) -> None:
        self.inner = inner
        self.name = name
        self._on_failure = on_failure
        self.num_failures = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as e:
            result = SpanExportResult.FAILURE
            logger.debug("span exporter %s raised: %s", self.name, e)
        if result != SpanExportResult.SUCCESS:
            self.num_failures += 1
            if self.num_failures in (1, 10, 100) or self.num_failures % 1000 == 0:
                logger.warning("span export to %s failed (%d so far)", self.name, self.num_failures)
            self._on_failure(self.name)
        return result

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        except Exception:
            logger.debug("span exporter %s shutdown failed", self.name, exc_info=True)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis)
        except Exception:
            return False


class CountingMetricExporter(MetricExporter):
    """Metric twin of :class:`CountingSpanExporter`."""

    def __init__(self, inner: MetricExporter, name: str, on_failure: OnFailure) -> None:
        super().__init__()
        self.inner = inner
        self.name = name
        self._on_failure = on_failure
        self.num_failures = 0

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object
    ) -> MetricExportResult:
        try:
            result = self.inner.export(metrics_data, timeout_millis=timeout_millis)
        except Exception as e:
            result = MetricExportResult.FAILURE
            logger.debug("metric exporter %s raised: %s", self.name, e)
        if result != MetricExportResult.SUCCESS:
            self.num_failures += 1
            if self.num_failures in (1, 10, 100) or self.num_failures % 1000 == 0:
                logger.warning(
                    "metric export to %s failed (%d so far)", self.name, self.num_failures
                )
            self._on_failure(self.name)
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis)
        except Exception:
            return False

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        try:
            self.inner.shutdown(timeout_millis=timeout_millis)
        except Exception:
            logger.debug("metric exporter %s shutdown failed", self.name, exc_info=True)


class _JsonlFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write_lines(self, lines: list[str]) -> None:
        if not lines:
            return
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = open_append(self.path)
            with os.fdopen(fd, "a", encoding="utf-8") as f:
                f.write("".join(lines))


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.context
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x") if ctx else None,
        "span_id": format(ctx.span_id, "016x") if ctx else None,
        "parent_span_id": format(parent.span_id, "016x") if parent else None,
        "start": (span.start_time or 0) / 1e9,
        "end": (span.end_time or 0) / 1e9,
        "status": span.status.status_code.name if span.status else "UNSET",
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time": e.timestamp / 1e9, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
        "links": [
            {
                "trace_id": format(lk.context.trace_id, "032x"),
                "span_id": format(lk.context.span_id, "016x"),
            }
            for lk in span.links
        ],
        "resource": dict(span.resource.attributes) if span.resource else {},
    }


class JsonlSpanExporter(SpanExporter):
    """Appends finished spans to ``path`` as JSON lines."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._file = _JsonlFile(Path(path))

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            self._file.write_lines([json.dumps(span_to_dict(s), default=str) + "\n" for s in spans])
        except OSError as e:
            logger.warning("could not write spans to %s: %s", self._file.path, e)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class JsonlMetricExporter(MetricExporter):
    """Appends one JSON line per data point (name, unit, attributes, value or histogram)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self._file = _JsonlFile(Path(path))

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object
    ) -> MetricExportResult:
        lines = []
        for rm in metrics_data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for p in m.data.data_points:
                        rec: dict[str, Any] = {
                            "time": p.time_unix_nano / 1e9,
                            "name": m.name,
                            "unit": m.unit,
                            "attributes": dict(p.attributes or {}),
                        }
                        if hasattr(p, "value"):
                            rec["value"] = p.value
                        else:
                            rec.update(count=p.count, sum=p.sum, min=p.min, max=p.max)
                        lines.append(json.dumps(rec, default=str) + "\n")
        try:
            self._file.write_lines(lines)
        except OSError as e:
            logger.warning("could not write metrics to %s: %s", self._file.path, e)
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        return None


def resolve_otlp(
    endpoint: str | None, protocol: str | None, env: dict[str, str] | None = None
) -> tuple[str, str] | None:
    """(endpoint, protocol) from the config, else ``OTEL_EXPORTER_OTLP_*``; None when unset."""
    env = dict(os.environ) if env is None else env
    ep = endpoint or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not ep:
        return None
    proto = protocol or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if proto not in ("grpc", "http/protobuf"):
        logger.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%r unsupported; using grpc", proto)
        proto = "grpc"
    return ep, proto


def build_otlp_exporters(
    endpoint: str, protocol: str, *, timeout_s: float
) -> tuple[SpanExporter, MetricExporter] | None:
    """OTLP span + metric exporters, or None (with a warning) when the package is missing."""
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            target = endpoint.split("://", 1)[-1]
            insecure = not endpoint.startswith("https://")
            return (
                OTLPSpanExporter(endpoint=target, insecure=insecure, timeout=timeout_s),
                OTLPMetricExporter(endpoint=target, insecure=insecure, timeout=timeout_s),
            )
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter as HttpMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpSpanExporter,
        )

        base = endpoint.rstrip("/")
        return (
            HttpSpanExporter(endpoint=base + "/v1/traces", timeout=timeout_s),
            HttpMetricExporter(endpoint=base + "/v1/metrics", timeout=timeout_s),
        )
    except ImportError as e:
        logger.warning(
            "OTLP export to %s disabled: %s (pip install 'trainguard[otlp]')", endpoint, e
        )
        return None
