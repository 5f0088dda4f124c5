"""The default set of agent plugins, built from the config (a name → factory registry)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainguard.core.config import TrainGuardConfig
from trainguard.core.events import EventLog
from trainguard.core.plugin import AgentPlugin

__all__ = ["default_plugins", "start_ft"]


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
    return plugins


def start_ft(cfg: TrainGuardConfig, run_dir: Path) -> Any:
    """torchft mode: find or start the lighthouse and export torchft's env to the workers.
    Returns the :class:`trainguard.ft.Lighthouse` (its ``stop()`` stops one we started).
    Raises ConfigError (one line) where torchft cannot run."""
    from trainguard.core.config import ConfigError
    from trainguard.ft import FTUnavailable, ensure_lighthouse

    try:
        lighthouse = ensure_lighthouse(cfg.ft, run_dir)
    except FTUnavailable as e:
        raise ConfigError(str(e)) from None
    os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse.url
    if cfg.ft.replica_group >= 0:
        os.environ["REPLICA_GROUP_ID"] = str(cfg.ft.replica_group)
    EventLog(run_dir).emit(
        "ft_lighthouse",
        url=lighthouse.url,
        started=lighthouse.pid is not None,
        pid=lighthouse.pid,
        replica_group=os.environ.get("REPLICA_GROUP_ID", "0"),
    )
    return lighthouse
