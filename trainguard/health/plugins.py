"""The health component's agent plugins, built from the config."""

from __future__ import annotations

from trainguard.core.contracts.rundir import RunDir
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

        plugins.append(
            HealthMonitor(
                h,
                run_dir=ctx.run_dir,
                rdzv_endpoint=_probe_endpoint(ctx.rdzv_endpoint),
                checkpoint_dir=h.checkpoint_dir or _local_checkpoint_root(ctx),
            )
        )
    if h.hang_detection:
        from trainguard.health.hang import HangDetector

        plugins.append(HangDetector(h, heartbeat_interval_s=cfg.runtime.heartbeat_interval_s))
    if h.straggler_detection:
        from trainguard.health.straggler import StragglerDetector

        plugins.append(StragglerDetector(h))
    return plugins


def _probe_endpoint(endpoint: str) -> str | None:
    """The rendezvous endpoint to check for reachability; None for a port chosen at run time
    (``--standalone`` is ``localhost:0``) or none at all."""
    if not endpoint or endpoint.rsplit(":", 1)[-1] in ("", "0"):
        return None
    return endpoint


def _local_checkpoint_root(ctx: AgentContext) -> str | None:
    """The checkpoint directory the job writes to (``[checkpoint] dir``, default
    ``<run_dir>/checkpoints``) when it is a local path; None for a remote (fsspec) URL."""
    root = ctx.config.checkpoint.dir or str(RunDir(ctx.run_dir).checkpoints)
    return None if "://" in root else root
