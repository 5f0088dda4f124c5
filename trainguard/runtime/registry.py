"""The default set of agent plugins, built from the config (a name → factory registry)."""

from __future__ import annotations

from pathlib import Path

from trainguard.core.config import TrainGuardConfig
from trainguard.core.events import EventLog
from trainguard.core.plugin import AgentPlugin

__all__ = ["default_plugins"]


def default_plugins(cfg: TrainGuardConfig, run_dir: Path, events: EventLog) -> list[AgentPlugin]:
    """Plugins enabled by ``cfg``. Components register theirs here as they land."""
    plugins: list[AgentPlugin] = []
    if cfg.telemetry.enabled:
        from trainguard.telemetry.plugin import create_telemetry_plugin

        telemetry = create_telemetry_plugin(cfg.telemetry, run_dir, events)
        if telemetry is not None:
            plugins.append(telemetry)
    if cfg.health.enabled:
        from trainguard.health.plugins import health_plugins

        plugins.extend(health_plugins(cfg, run_dir, events))
    if cfg.checkpoint.enabled and cfg.checkpoint.memory_tier:
        from trainguard.checkpoint.memtier import MemoryTierPlugin

        plugins.append(MemoryTierPlugin(cfg.checkpoint, run_dir, events))
    if cfg.alerts.webhook_url:
        from trainguard.dashboards.pager import create_pager_plugin

        pager = create_pager_plugin(cfg.alerts, run_dir, events)
        if pager is not None:
            plugins.append(pager)
    return plugins
