"""Configuration of the agent runtime (run directory, progress channel)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    run_dir: str | None = None
    """Run directory; default ``<runs_root>/<run_id>``."""
    runs_root: str = "trainguard-runs"
    """Parent of per-run directories when ``run_dir`` is not set."""
    heartbeat_interval_s: float = 1.0
    """How often a worker's background thread refreshes its heartbeat."""

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
