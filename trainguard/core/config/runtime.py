"""Configuration of the agent runtime (run directory, progress channel)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    run_dir: str | None = None
    """Run directory; default ``<runs_root>/<run_id>``."""
    runs_root: str = "trainguard-runs"
    """Parent of per-run directories when ``run_dir`` is not set."""
    dir_mode: str = "0700"
    """Mode (octal) of the run directory and of a local checkpoint directory trainguard creates:
    private to the job's user by default (they hold events, config, metrics, hang dumps and the
    weights). ``"0750"`` lets the group read them. Existing directories are left as they are."""
    heartbeat_interval_s: float = 1.0
    """How often a worker's background thread refreshes its heartbeat."""
    preemption_signals_direct: bool = False
    """The scheduler sends the preemption signals (``[checkpoint] preemption_signals``) to every
    process of the job step, workers included (Slurm's ``--signal`` without ``B:``): the agent
    then only logs them instead of forwarding them, so no worker gets one twice (a second
    signal stops a worker before its preemption save commits). Set by ``trainguard sbatch``."""

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
        try:
            mode = int(str(self.dir_mode), 8)
        except ValueError:
            mode = -1
        if not 0o700 <= mode <= 0o777:
            raise ValueError(
                f"dir_mode {self.dir_mode!r}: expected an octal mode from 0700 to 0777, e.g. 0750"
            )

    @property
    def dir_mode_bits(self) -> int:
        """:attr:`dir_mode` as a number."""
        return int(str(self.dir_mode), 8)
