"""A node's health: every present source probed, one verdict (:class:`NodeReport`)."""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainguard.core.config.health import HealthConfig
from trainguard.health.policy import Policy
from trainguard.health.result import (
    HealthAction,
    ProbeResult,
    Status,
    worst_action,
    worst_status,
)

__all__ = ["HealthSource", "NodeProbe", "NodeReport", "build_sources"]

logger = logging.getLogger(__name__)

GPU_SOURCES = ("dcgm_exporter", "dcgm", "nvml")


class HealthSource(Protocol):
    name: str

    def probe(self) -> ProbeResult: ...


@dataclass(slots=True)
class NodeReport:
    """The verdict over all present sources. ``exit_code``: 0 healthy, 1 degraded (warn or
    unknown), 2 unhealthy (fail)."""

    node: str
    results: list[ProbeResult]
    time: float = field(default_factory=time.time)
    extra: list[ProbeResult] = field(default_factory=list)

    @property
    def counted(self) -> list[ProbeResult]:
        return [r for r in self.results + self.extra if r.present]

    @property
    def status(self) -> Status:
        return worst_status([r.status for r in self.counted])

    @property
    def action(self) -> HealthAction:
        return worst_action([r.action for r in self.counted])

    @property
    def reasons(self) -> list[str]:
        return [f"{r.source}: {why}" for r in self.counted for why in r.reasons]

    @property
    def gpu_sources(self) -> list[str]:
        return [r.source for r in self.counted if r.source in GPU_SOURCES]

    @property
    def exit_code(self) -> int:
        return {Status.OK: 0, Status.WARN: 1, Status.UNKNOWN: 1, Status.FAIL: 2}[self.status]

    def note(self) -> str:
        if self.gpu_sources:
            return "GPU sources: " + ", ".join(self.gpu_sources)
        return "no GPU source present (CPU-only node): host checks only"

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "time": self.time,
            "status": self.status.value,
            "action": self.action.value,
            "exit_code": self.exit_code,
            "reasons": self.reasons,
            "note": self.note(),
            "sources": [r.to_dict() for r in self.results + self.extra],
        }

    def summary(self) -> dict[str, Any]:
        """Small form for events."""
        return {
            "status": self.status.value,
            "action": self.action.value,
            "reasons": self.reasons[:20],
            "sources": {r.source: r.status.value for r in self.counted},
        }


def build_sources(
    cfg: HealthConfig,
    *,
    policy: Policy | None = None,
    dcgm_url: str | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    rdzv_endpoint: str | None = None,
) -> list[HealthSource]:
    """The configured sources, in order. Nothing GPU-related is imported unless used."""
    policy = policy or Policy.from_overrides(
        cfg.xid_policy, cfg.counter_policy, cfg.unknown_xid_action
    )
    sources: list[HealthSource] = []
    for name in cfg.sources:
        if name == "dcgm_exporter":
            from trainguard.health.dcgm_exporter import DcgmExporterSource

            sources.append(
                DcgmExporterSource(cfg, policy, url=dcgm_url, explicit=True if dcgm_url else None)
            )
        elif name == "dcgm":
            from trainguard.health.dcgm import DcgmSource

            sources.append(DcgmSource(cfg, policy))
        elif name == "nvml":
            from trainguard.health.nvml import NvmlSource

            sources.append(NvmlSource(cfg, policy))
        elif name == "host":
            from trainguard.health.host import HostSource

            sources.append(
                HostSource(cfg, policy, checkpoint_dir=checkpoint_dir, rdzv_endpoint=rdzv_endpoint)
            )
    return sources


class NodeProbe:
    """Probes every source; a raising source becomes ``unknown`` (probes never raise)."""

    def __init__(self, sources: list[HealthSource], *, node: str | None = None) -> None:
        self.sources = sources
        self.node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()

    def probe(self) -> NodeReport:
        results = []
        for src in self.sources:
            try:
                results.append(src.probe())
            except Exception as e:
                logger.exception("health source %s raised", src.name)
                results.append(ProbeResult.unknown(src.name, f"probe raised: {e!r}"))
        return NodeReport(node=self.node, results=results)

    def close(self) -> None:
        for src in self.sources:
            close = getattr(src, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    logger.exception("closing health source %s failed", src.name)
