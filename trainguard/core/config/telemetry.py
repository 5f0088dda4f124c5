"""Configuration of trainguard.telemetry (section [telemetry] of trainguard.toml, env TRAINGUARD_TELEMETRY_*)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class TelemetryConfig:
    enabled: bool = True
    """Switch the telemetry component on or off (JSONL records of the workers stay on)."""
    prometheus: bool = True
    """Serve ``/metrics`` from each node's agent (workers never open a port)."""
    prometheus_host: str = "127.0.0.1"
    """Address the node's metrics endpoint binds to."""
    prometheus_port: int = 9464
    """Port of the node's metrics endpoint; 0 picks a free one. When the port is taken the agent
    falls back to a free port. The port in use is written to ``<run_dir>/prometheus_<node>.json``."""
    otlp_endpoint: str | None = None
    """OTLP collector endpoint (e.g. ``http://127.0.0.1:4317``); falls back to
    ``OTEL_EXPORTER_OTLP_ENDPOINT``. Unset in both: no OTLP export."""
    otlp_protocol: Literal["grpc", "http/protobuf"] | None = None
    """OTLP protocol; falls back to ``OTEL_EXPORTER_OTLP_PROTOCOL``, then ``grpc``."""
    otlp_timeout_s: float = 3.0
    """Timeout of one OTLP export call (exports run on background threads)."""
    export_interval_s: float = 5.0
    """How often metrics are pushed to OTLP and to the agent's JSONL snapshot."""
    poll_interval_s: float = 0.5
    """How often the agent reads its workers' new metric records."""
    trace_every_n_steps: int = 10
    """Step spans are sampled: steps 0..2 and every n-th step get a span (0: no step spans)."""
    flush_interval_s: float = 0.2
    """How often a worker's background thread appends its buffered metric records to
    ``metrics/rank_<r>.jsonl`` (a SIGKILL loses at most this much)."""
    flops_per_step: float | None = None
    """FLOPs one rank executes per step, when the script passes none to ``tg.step``."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device, overriding the built-in table (needed for MFU on CPUs)."""
    device_name: str | None = None
    """Device model used to look up the peak (default: what the workers report)."""

    def __post_init__(self) -> None:
        if not 0 <= self.prometheus_port <= 65535:
            raise ValueError("prometheus_port must be in 0..65535")
        if self.otlp_timeout_s <= 0:
            raise ValueError("otlp_timeout_s must be > 0")
        if self.export_interval_s <= 0:
            raise ValueError("export_interval_s must be > 0")
        if self.poll_interval_s <= 0:
            raise ValueError("poll_interval_s must be > 0")
        if self.flush_interval_s <= 0:
            raise ValueError("flush_interval_s must be > 0")
        if self.trace_every_n_steps < 0:
            raise ValueError("trace_every_n_steps must be >= 0")
        if self.flops_per_step is not None and self.flops_per_step <= 0:
            raise ValueError("flops_per_step must be > 0")
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ValueError("peak_flops must be > 0 (FLOP/s of one device)")
