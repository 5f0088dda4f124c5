"""Configuration of the loss guard (section [rollback] of trainguard.toml, env TRAINGUARD_ROLLBACK_*).

When ``tg.log(loss=...)`` reports a non-finite loss, or a spike above ``spike_factor`` times
the rolling median, every rank rolls back to the newest checkpoint at or before the offending
step (memory tier or disk) and skips the offending data window. Example::

    [rollback]
    spike_factor = 10.0     # also roll back on loss > 10 x the median of the last `window`
    window = 100
    skip_before = 0         # steps before the offending one also skipped
    max_rollbacks = 3       # at one place; one more anomaly there stops the job (exit 93)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class RollbackConfig:
    enabled: bool = True
    """Watch the logged loss and roll back on an anomaly (needs ``tg.checkpoint.maybe_save``
    in the loop: the ranks agree on it in the all-reduce ``maybe_save`` already does)."""
    metric: str = "loss"
    """The ``tg.log`` key watched."""
    nonfinite: bool = True
    """Roll back when the watched value is NaN or infinite."""
    spike_factor: float = 0.0
    """Roll back when the value exceeds this many times the rolling median of the last
    ``window`` values (only while that median is > 0); 0: off."""
    window: int = 100
    """Values in the rolling median."""
    min_history: int = 20
    """Values needed before spike detection starts."""
    skip_before: int = 0
    """Steps before the offending step that are skipped too (the rollback restores a
    checkpoint at or before the first skipped step)."""
    skip_after: int = 0
    """Steps after the offending step that are skipped too."""
    max_rollbacks: int = 3
    """Rollbacks at one place; the next anomaly there stops the job with the "do not
    requeue" exit code (93)."""
    place_steps: int = 50
    """An anomaly at most this many steps after the previous rollback's skipped window (and
    not before its restored step) is at the same place: the next rollback goes to an older
    checkpoint and skips everything from it to the anomaly."""

    def __post_init__(self) -> None:
        for name in ("skip_before", "skip_after", "place_steps", "min_history"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.window < 1:
            raise ValueError("window must be >= 1")
        if self.max_rollbacks < 1:
            raise ValueError("max_rollbacks must be >= 1 (enabled = false switches it off)")
        if self.spike_factor != 0 and self.spike_factor <= 1:
            raise ValueError("spike_factor must be > 1 (or 0: off)")
        if not self.metric:
            raise ValueError("metric must name a tg.log key, e.g. 'loss'")
