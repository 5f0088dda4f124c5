"""Checkpoint interval: the goodput planner's optimum disk interval for the costs this job
measures (``trainguard.plan``), or Young's approximation tau = sqrt(2 * stall * MTBF).

The stall is the measured per-checkpoint loss of training time (median of recent saves), the
commit the measured save → committed time (a save is only usable once committed, and one
persist is in flight at a time); the MTBF is the configured one until this run has observed
failures (its ``worker_failed`` events); the share of failures the memory tier recovers is the
share of this run's restores after a failure that came from memory (0 until one is observed,
which makes every failure need the disk, as Young assumes).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.core.contracts.event_kinds import LAUNCH, WORKER_FAILED

if TYPE_CHECKING:
    from trainguard.core.config.checkpoint import CheckpointConfig

__all__ = [
    "IntervalPolicy",
    "observed_memory_fraction",
    "observed_mtbf_s",
    "planned_interval_s",
    "young_interval_s",
]

RESTART_S = 3.4
"""Restart cost the planner assumes (kill -9 → next step under trainguard run, measured)."""


def young_interval_s(
    stall_s: float, mtbf_s: float, *, lo: float = 0.0, hi: float = math.inf
) -> float:
    """sqrt(2 * stall * MTBF), clamped to [lo, hi]."""
    tau = math.sqrt(2.0 * max(stall_s, 1e-6) * mtbf_s)
    return min(max(tau, lo), hi)


def planned_interval_s(
    stall_s: float,
    mtbf_s: float,
    *,
    commit_s: float = 0.0,
    memory_fraction: float = 0.0,
    restart_s: float = RESTART_S,
    lo: float = 0.0,
    hi: float = math.inf,
) -> float:
    """The disk interval that maximises the planner's ETTR (trainguard.plan.model) for one
    job with these measured costs, clamped to [lo, hi]. ``memory_fraction`` of the failures
    restore from the memory tier (saved every second here, at no extra cost: those saves
    happen anyway; its interval hardly moves the disk optimum); the rest need the disk."""
    from trainguard.plan.model import JobSpec, Tier, best_disk_interval

    stall = max(stall_s, 1e-6)
    mtbf = max(mtbf_s, 1.0)
    memory = None
    if memory_fraction > 0:
        memory = Tier(interval_s=1.0, stall_s=0.0, restore_s=0.0)
    spec = JobSpec(
        gpus=1,
        mtti_s=mtbf,
        work_s=100 * mtbf,
        memory=memory,
        disk=Tier(interval_s=max(stall, commit_s, 1.0), stall_s=stall, commit_s=commit_s),
        peer_replication=False,
        restart_s=restart_s,
        detect_s=0.0,
        node_loss_fraction=1.0 - min(1.0, memory_fraction),
    )
    tau = best_disk_interval(spec, hi=hi if math.isfinite(hi) else None)
    return min(max(tau, lo), hi)


def observed_memory_fraction(run_dir: Path) -> float:
    """Share of this run's restores after a failure (attempt > 0) that came from memory."""
    from trainguard.core.events import read_events

    mem = disk = 0
    for e in read_events(run_dir):
        if e.get("kind") == "checkpoint_restored" and int(e.get("attempt", 0)) > 0:
            if e.get("rank", 0) != 0:
                continue
            src = str(e.get("source", ""))
            if "memory" in src:
                mem += 1
            elif src not in ("", "none"):
                disk += 1
    return mem / (mem + disk) if mem + disk else 0.0


def observed_mtbf_s(run_dir: Path) -> float | None:
    """Mean time between failures of this run so far (from its events), or None before the
    first failure."""
    from trainguard.core.events import read_events

    start: float | None = None
    failed_attempts: set[int] = set()
    for e in read_events(run_dir):
        if e.get("kind") == LAUNCH and start is None:
            start = float(e["time"])
        elif e.get("kind") == WORKER_FAILED:
            failed_attempts.add(int(e.get("attempt", 0)))
    if start is None or not failed_attempts:
        return None
    return max(time.time() - start, 1.0) / len(failed_attempts)


class IntervalPolicy:
    """When ``maybe_save`` persists: every N steps, every T seconds, or the planner's optimum
    from the median of the recent stalls and commits, the MTBF and the memory tier's share of
    recoveries, re-evaluated as they are measured. ``on_change(interval_s, stall_s, mtbf_s)``
    is called when the interval moves by > 20 %."""

    def __init__(self, config: CheckpointConfig, *, on_change: Callable[..., object]) -> None:
        self.config = config
        self.on_change = on_change
        self.stalls: deque[float] = deque(maxlen=20)
        self.commits: deque[float] = deque(maxlen=20)
        self.memory_fraction = 0.0
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

    def record_commit(self, commit_s: float) -> None:
        self.commits.append(commit_s)
        self.update()

    def set_mtbf(self, mtbf_s: float) -> None:
        self.mtbf_s = mtbf_s
        self.update()

    def set_memory_fraction(self, fraction: float) -> None:
        self.memory_fraction = fraction
        self.update()

    def update(self) -> None:
        if not self.config.auto_interval or not self.stalls:
            return
        stall = sorted(self.stalls)[len(self.stalls) // 2]
        commit = sorted(self.commits)[len(self.commits) // 2] if self.commits else 0.0
        tau = planned_interval_s(
            stall,
            self.mtbf_s,
            commit_s=commit,
            memory_fraction=self.memory_fraction,
            lo=self.config.auto_min_interval_s,
            hi=self.config.auto_max_interval_s,
        )
        old, self.interval_s = self.interval_s, tau
        if old is None or abs(tau - old) > 0.2 * old:
            self.on_change(tau, stall, self.mtbf_s)
