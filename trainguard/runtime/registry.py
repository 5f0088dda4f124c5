"""The default set of agent plugins, built from the config (the only agent-side module that
imports the features)."""

from __future__ import annotations

from trainguard.core.plugin import AgentContext, AgentPlugin

__all__ = ["default_plugins"]


def default_plugins(ctx: AgentContext) -> list[AgentPlugin]:
    """Plugins enabled by ``ctx.config``. Components register theirs here as they land."""
    cfg = ctx.config
    plugins: list[AgentPlugin] = []
    if cfg.telemetry.enabled:
        from trainguard.telemetry.plugin import create_telemetry_plugin

        telemetry = create_telemetry_plugin(ctx)
        if telemetry is not None:
            plugins.append(telemetry)
    if cfg.health.enabled:
        from trainguard.health.plugins import health_plugins

        plugins.extend(health_plugins(ctx))
    if cfg.checkpoint.enabled and cfg.checkpoint.memory_tier:
        from trainguard.checkpoint.memtier.plugin import MemoryTierPlugin

        plugins.append(MemoryTierPlugin(ctx))
    return plugins
