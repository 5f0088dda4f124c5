"""Checkpoint interval: Young's approximation tau = sqrt(2 * stall * MTBF).

The stall is the measured per-checkpoint loss of training time (median of recent saves); the
MTBF is the configured one until this run has observed failures (its ``worker_failed`` events).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.core.config.checkpoint import CheckpointConfig

__all__ = ["IntervalPolicy", "observed_mtbf_s", "young_interval_s"]


def young_interval_s(
    stall_s: float, mtbf_s: float, *, lo: float = 0.0, hi: float = math.inf
) -> float:
    """sqrt(2 * stall * MTBF), clamped to [lo, hi]."""
    tau = math.sqrt(2.0 * max(stall_s, 1e-6) * mtbf_s)
    return min(max(tau, lo), hi)


def observed_mtbf_s(run_dir: Path) -> float | None:
    """Mean time between failures of this run so far (from its events), or None before the
    first failure."""
    from trainguard.core.events import read_events

    start: float | None = None
    failed_attempts: set[int] = set()
    for e in read_events(run_dir):
        if e.get("kind") == "launch" and start is None:
            start = float(e["time"])
        elif e.get("kind") == "worker_failed":
            failed_attempts.add(int(e.get("attempt", 0)))
    if start is None or not failed_attempts:
        return None
    return max(time.time() - start, 1.0) / len(failed_attempts)


class IntervalPolicy:
    """When ``maybe_save`` persists: every N steps, every T seconds, or Young's interval from
    the median of the recent stalls and the MTBF, re-evaluated as stalls are measured.
    ``on_change(interval_s, stall_s, mtbf_s)`` is called when the interval moves by > 20 %."""

    def __init__(self, config: CheckpointConfig, *, on_change: Callable[..., Any]) -> None:
        self.config = config
        self.on_change = on_change
        self.stalls: deque[float] = deque(maxlen=20)
        self.mtbf_s = config.mtbf_s
        self.interval_s: float | None = None
        self.last_persist = time.monotonic()

    def due(self, step: int) -> bool:
        c = self.config
        if c.every_steps and step > 0 and step % c.every_steps == 0:
            return True
        elapsed = time.monotonic() - self.last_persist
        if c.every_s and elapsed >= c.every_s:
            return True
        return bool(c.auto_interval and self.interval_s is not None and elapsed >= self.interval_s)

    def persisted(self) -> None:
        self.last_persist = time.monotonic()

    def record_stall(self, stall_s: float) -> None:
        self.stalls.append(stall_s)
        self.update()

    def set_mtbf(self, mtbf_s: float) -> None:
        self.mtbf_s = mtbf_s
        self.update()

    def update(self) -> None:
        if not self.config.auto_interval or not self.stalls:
            return
        stall = sorted(self.stalls)[len(self.stalls) // 2]
        tau = young_interval_s(
            stall,
            self.mtbf_s,
            lo=self.config.auto_min_interval_s,
            hi=self.config.auto_max_interval_s,
        )
        old, self.interval_s = self.interval_s, tau
        if old is None or abs(tau - old) > 0.2 * old:
            self.on_change(tau, stall, self.mtbf_s)
