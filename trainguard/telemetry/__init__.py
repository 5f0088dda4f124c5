"""trainguard.telemetry: metrics, traces, goodput and the HTML report.

- :mod:`~trainguard.core.contracts.metrics`: the metric contract (names, units, descriptions,
  Prometheus names) shared with dashboards, alert rules and the report;
- :mod:`~trainguard.telemetry.spans`: worker-side spans as JSON records (``tg.span``);
- :mod:`~trainguard.telemetry.plugin`: the node agent's plugin (JSONL, ``/metrics``, OTLP);
- :mod:`~trainguard.core.goodput` (shared with the planner's run reader),
  :mod:`~trainguard.telemetry.mfu`, :mod:`~trainguard.telemetry.report`.

Importing this package is cheap: the OpenTelemetry SDK loads only in the agent's plugin.
"""

from __future__ import annotations

from trainguard.core.contracts.metrics import (
    LOSS_CAUSES,
    METRICS,
    MetricSpec,
    by_name,
    prometheus_name,
)

__all__ = ["LOSS_CAUSES", "METRICS", "MetricSpec", "by_name", "prometheus_name"]
