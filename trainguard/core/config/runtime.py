"""Configuration of the agent runtime (run directory, progress channel)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    run_dir: str | None = None
    """Run directory; default ``<runs_root>/<run_id>``."""
    runs_root: str = "trainguard-runs"
    """Parent of per-run directories when ``run_dir`` is not set."""
    heartbeat_interval_s: float = 1.0
    """How often a worker's background thread refreshes its heartbeat."""
    preemption_signals_direct: bool = False
    """The scheduler sends the preemption signals (``[checkpoint] preemption_signals``) to every
    process of the job step, workers included (Slurm's ``--signal`` without ``B:``): the agent
    then only logs them instead of forwarding them, so no worker gets one twice (a second
    signal stops a worker before its preemption save commits). Set by ``trainguard sbatch``."""
    warm_restarts: bool = True
    """Restart workers from pre-started processes that already imported torch (one per local
    rank, started ``warm_prestart_delay_s`` after each start, while a restart can still follow:
    restarts left, or more than one node): a restart skips interpreter and ``import torch``
    start-up. The first start is always cold. ``--no-tg-warm`` turns it off."""
    warm_preload: list[str] = field(
        default_factory=lambda: [
            "torch",
            "torch.distributed",
            "torch.nn.parallel",
            "torch._dynamo",
            "torch.distributed.checkpoint",
            "trainguard.worker.api",
        ]
    )
    """Modules a warm process imports before it waits (import errors are ignored there: the
    worker meets them itself). ``torch._dynamo`` is as slow to import as torch (~1.2 s CPU)
    and the ``DistributedDataParallel`` constructor imports it."""
    warm_prestart_delay_s: float = 5.0
    """Seconds after a start before the warm processes for the next restart are started (they
    would otherwise compete for CPU with the starting workers)."""

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
        if self.warm_prestart_delay_s < 0:
            raise ValueError("warm_prestart_delay_s must be >= 0")
