"""The health component's agent plugins, built from the config."""

from __future__ import annotations

from trainguard.core.plugin import AgentContext, AgentPlugin

__all__ = ["health_plugins"]


def health_plugins(ctx: AgentContext) -> list[AgentPlugin]:
    """Preflight + in-job probing, hang detection and straggler detection, as configured."""
    cfg = ctx.config
    h = cfg.health
    plugins: list[AgentPlugin] = []
    if not h.enabled:
        return plugins
    if h.preflight or h.probe_interval_s > 0:
        from trainguard.health.monitor import HealthMonitor

        plugins.append(HealthMonitor(h, run_dir=ctx.run_dir))
    if h.hang_detection:
        from trainguard.health.hang import HangDetector

        plugins.append(HangDetector(h, heartbeat_interval_s=cfg.runtime.heartbeat_interval_s))
    if h.straggler_detection:
        from trainguard.health.straggler import StragglerDetector

        plugins.append(StragglerDetector(h))
    return plugins
