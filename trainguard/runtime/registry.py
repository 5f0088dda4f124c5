"""The default set of agent plugins, built from the config (the only agent-side module that
imports the features)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainguard.core.config import TrainGuardConfig
from trainguard.core.contracts import envvars
from trainguard.core.events import EventLog
from trainguard.core.fencing import NodeFencer, RecordOnlyFencer
from trainguard.core.plugin import AgentContext, AgentPlugin, WorkerHooksPlugin

__all__ = ["default_plugins", "node_fencer", "recovery_summary", "start_ft"]

INTEGRATIONS_HOOK = "trainguard.integrations.auto:install"
"""The worker start-up hook entry of ``[integrations] auto`` (a name: the agent never imports
the worker side)."""


def _in_trainguard_sbatch_job() -> bool:
    return bool(os.environ.get(envvars.SBATCH_CHAIN_ID) and os.environ.get("SLURM_JOB_ID"))


def node_fencer(cfg: TrainGuardConfig) -> NodeFencer:
    """How an evicted node is taken out of service: Slurm's drain in a job started by
    ``trainguard sbatch`` (``[slurm] drain = "record"``: recorded only), else recorded only."""
    if _in_trainguard_sbatch_job():
        from trainguard.slurm.cli import make_slurm
        from trainguard.slurm.fencer import SlurmFencer

        return SlurmFencer(make_slurm(), record_only=cfg.slurm.drain == "record")
    return RecordOnlyFencer()


def default_plugins(ctx: AgentContext) -> list[AgentPlugin]:
    """Plugins enabled by ``ctx.config``. Components register theirs here as they land."""
    cfg = ctx.config
    from trainguard.recovery.plugin import RecoveryPlugin

    # first: a blocklisted node refuses to join before any preflight work
    plugins: list[AgentPlugin] = [RecoveryPlugin(ctx, fencer=node_fencer(cfg))]
    if cfg.fleet.enabled:
        from trainguard.fleet.plugin import FleetPlugin

        plugins.append(FleetPlugin(ctx))  # then: a lemon node refuses to join
    if cfg.roles.specs():
        from trainguard.roles.plugin import RolesPlugin

        # the engine fleets start before the trainer's first workers, and outlive its restarts
        plugins.append(RolesPlugin(ctx, fencer=node_fencer(cfg)))
    if cfg.warm.enabled:
        from trainguard.runtime.warm import WarmPlugin

        plugins.append(WarmPlugin(ctx))  # sets ctx.warm_pool, which the agent starts through
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
    if cfg.alerts.webhook_url:
        from trainguard.dashboards.pager import create_pager_plugin

        pager = create_pager_plugin(cfg.alerts, ctx.run_dir, ctx.events)
        if pager is not None:
            plugins.append(pager)
    from trainguard.dashboards.watch import heartbeat_plugin

    beat = heartbeat_plugin(ctx, cfg.alerts)
    if beat is not None:
        plugins.append(beat)
    if cfg.integrations.auto:
        # trainguard attaches itself to transformers' / Lightning's Trainer in the workers
        plugins.append(WorkerHooksPlugin("integrations", INTEGRATIONS_HOOK))
    if _in_trainguard_sbatch_job():
        from trainguard.slurm.cli import make_slurm
        from trainguard.slurm.plugin import SlurmDrainPlugin

        plugins.append(
            SlurmDrainPlugin(
                node_fencer(cfg), ctx.events, os.environ["SLURM_JOB_ID"], slurm=make_slurm()
            )
        )
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


def recovery_summary(run_dir: Path) -> list[str]:
    """What failed and how the job recovered, in a few lines (the telemetry feature's summary
    of the run's events), for ``trainguard run`` to print at the end."""
    from trainguard.telemetry.summary import recovery_summary as summary

    return summary(run_dir)
