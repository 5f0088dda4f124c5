"""Checkpoint interval: Young's approximation tau = sqrt(2 * stall * MTBF).

The stall is the measured per-checkpoint loss of training time (median of recent saves); the
MTBF is the configured one until this run has observed failures (its ``worker_failed`` events).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

__all__ = ["observed_mtbf_s", "young_interval_s"]


def young_interval_s(
    stall_s: float, mtbf_s: float, *, lo: float = 0.0, hi: float = math.inf
) -> float:
    """sqrt(2 * stall * MTBF), clamped to [lo, hi]."""
    tau = math.sqrt(2.0 * max(stall_s, 1e-6) * mtbf_s)
    return min(max(tau, lo), hi)


def observed_mtbf_s(run_dir: Path) -> float | None:
    """Mean time between failures of this run so far (from its events), or None before the
    first failure."""
    from trainguard.runtime.events import read_events

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
