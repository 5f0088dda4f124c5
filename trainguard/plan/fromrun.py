"""Costs of a real run, read from its run directory: ``events.jsonl`` (launch, failures,
restarts, checkpoint commits and restores, job end) and ``metrics/rank_*.jsonl`` (step times,
checkpoint stalls) of the lowest rank.

From them: the work done (step time of steps done for the first time), start-up and shutdown,
per-save stall, memory and disk intervals, commit and restore times, detection (last step →
failure event), restart (failure → first step of the next attempt, less the restore), the
other time between steps, and the observed interruption rate. ``run_spec`` turns them into a
:class:`JobSpec` of the same job, whose model ETTR can be held against the run's own.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.core.contracts.event_kinds import (
    CHECKPOINT_COMMITTED,
    CHECKPOINT_RESTORED,
    JOB_FINISHED,
)
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import launch_time, read_events
from trainguard.core.goodput import GoodputTracker, failures_by_attempt
from trainguard.plan.model import JobSpec, Tier, fit_rate

__all__ = ["RunCosts", "read_run", "run_spec"]


@dataclass(slots=True)
class RunCosts:
    world_size: int
    wall_s: float
    productive_s: float
    measured_ettr: float
    startup_s: float
    step_s: float
    steps: int
    failures: int
    exposed_s: float
    memory_every_steps: int
    memory_stall_s: float
    disk_every_steps: int
    disk_stall_s: float
    disk_commit_s: float
    memory_restore_s: float | None
    disk_restore_s: float | None
    detect_s: float
    restart_s: float
    overhead_fraction: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _records(run_dir: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in RunDir(run_dir).metrics_files():
        with path.open(encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(r, dict) and r.get("kind") in ("step", "log"):
                    out.append(r)
    return out


def _median(values: list[float], default: float = 0.0) -> float:
    return float(statistics.median(values)) if values else default


@dataclass
class _Attempts:
    """The reference rank's steps, per attempt: when its first step started and its last
    ended, the step time summed; every first-time step time; the checkpoint stalls."""

    productive_s: float = 0.0
    first_start: dict[int, float] = field(default_factory=dict)
    last_end: dict[int, float] = field(default_factory=dict)
    step_sum: dict[int, float] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)
    max_step: int = -1
    stalls: list[float] = field(default_factory=list)
    stall_steps: set[int] = field(default_factory=set)


def _load(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The run's events (by time), its metrics records and its step records; ValueError
    naming what is missing."""
    events = sorted(read_events(run_dir), key=lambda e: float(e.get("time", 0.0)))
    if not events:
        raise ValueError(
            f"{RunDir(run_dir).events}: no events (missing or empty): pass a trainguard run "
            "directory (trainguard run --tg-run-dir DIR)"
        )
    recs = _records(run_dir)
    steps = [r for r in recs if r["kind"] == "step" and "step_time_s" in r]
    if not steps:
        raise ValueError(
            f"{RunDir(run_dir).metrics_dir}: no step records: the run never trained a step"
        )
    return events, recs, steps


def _scan_attempts(records: list[dict[str, Any]]) -> _Attempts:
    """One rank's records, in time order, into :class:`_Attempts`; productive time as
    trainguard's goodput counts it (a loss rollback takes back the steps it discarded; steps
    redone after a restart are not productive)."""
    out = _Attempts()
    tracker = GoodputTracker()
    for r in records:
        tracker.add(r)
        if r["kind"] == "log":
            v = r.get("checkpoint_stall_s")
            if isinstance(v, int | float) and not isinstance(v, bool):
                out.stalls.append(float(v))
                out.stall_steps.add(int(r.get("step", 0)))
            continue
        if r.get("failed"):
            continue
        dt, end, a = float(r["step_time_s"]), float(r["time"]), int(r.get("attempt", 0))
        out.max_step = max(out.max_step, int(r.get("step", 0)))
        out.step_times.append(dt)
        out.first_start.setdefault(a, end - dt)
        out.last_end[a] = max(out.last_end.get(a, end), end)
        out.step_sum[a] = out.step_sum.get(a, 0.0) + dt
    out.productive_s = tracker.productive_s
    return out


def _restore_times(events: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """Median restore time from the memory tier and from disk (rank 0; None: none seen)."""
    restores: dict[str, list[float]] = {"memory": [], "disk": []}
    for e in events:
        if e.get("kind") == CHECKPOINT_RESTORED and e.get("rank", 0) == 0:
            src = str(e.get("source", ""))
            key = "memory" if "memory" in src else "disk" if src not in ("none", "") else None
            if key:
                restores[key].append(float(e.get("duration_s") or 0.0))
    mem = _median(restores["memory"]) if restores["memory"] else None
    disk = _median(restores["disk"]) if restores["disk"] else None
    return mem, disk


def _detect_and_restart(
    failed: dict[int, float], att: _Attempts
) -> tuple[list[float], list[float]]:
    """Per failed attempt: detection (its last step → the failure) and restart (the failure
    → the first step of the next attempt)."""
    detects, restarts = [], []
    for a, t_fail in sorted(failed.items()):
        if a in att.last_end and att.last_end[a] <= t_fail:
            detects.append(t_fail - att.last_end[a])
        later = [att.first_start[b] for b in att.first_start if b > a]
        if later:
            restarts.append(min(later) - t_fail)
    return detects, restarts


def read_run(run_dir: str | Path) -> RunCosts:
    """The costs of the run in ``run_dir``; ValueError naming what is missing."""
    run_dir = Path(run_dir)
    events, recs, steps_all = _load(run_dir)
    ref = min(int(r.get("rank", 0)) for r in steps_all)
    mine = sorted((r for r in recs if int(r.get("rank", 0)) == ref), key=lambda r: float(r["time"]))
    att = _scan_attempts(mine)
    t0 = launch_time(events)  # the same start as trainguard's goodput (launcher start-up in)
    if t0 is None:
        t0 = min(att.first_start.values())
    finished = [float(e["time"]) for e in events if e.get("kind") == JOB_FINISHED]
    t_end = max(finished) if finished else max(att.last_end.values())
    a_first, a_last = min(att.first_start), max(att.last_end)
    startup = (att.first_start[a_first] - t0) + max(0.0, t_end - att.last_end[a_last])
    wall = t_end - t0

    failed = {
        a: min(float(e["time"]) for e in fevs) for a, fevs in failures_by_attempt(events).items()
    }
    mem_restore, disk_restore = _restore_times(events)
    detects, restarts = _detect_and_restart(failed, att)
    restore_used = mem_restore if mem_restore is not None else (disk_restore or 0.0)
    commits = [e for e in events if e.get("kind") == CHECKPOINT_COMMITTED]
    committed_steps = sorted({int(e["step"]) for e in commits if e.get("step") is not None})
    gaps = [b - a for a, b in zip(committed_steps, committed_steps[1:], strict=False)]
    steps_done = att.max_step + 1
    mem_every = max(1, round(steps_done / len(att.stall_steps))) if att.stall_steps else 0
    in_attempts = sum(att.last_end[a] - att.first_start[a] for a in att.last_end)
    running = sum(att.step_sum.values())
    stall_total = sum(att.stalls)
    exposed = max(wall - startup, 1e-9)
    return RunCosts(
        world_size=1 + max(int(r.get("rank", 0)) for r in steps_all),
        wall_s=wall,
        productive_s=att.productive_s,
        measured_ettr=att.productive_s / wall if wall > 0 else 0.0,
        startup_s=startup,
        step_s=_median(att.step_times),
        steps=steps_done,
        failures=len(failed),
        exposed_s=exposed,
        memory_every_steps=mem_every,
        memory_stall_s=stall_total / len(att.stalls) if att.stalls else 0.0,
        disk_every_steps=int(_median([float(g) for g in gaps], 0.0)) if gaps else 0,
        disk_stall_s=_median([float(e.get("stall_s") or 0.0) for e in commits]),
        disk_commit_s=_median([float(e.get("commit_s") or 0.0) for e in commits]),
        memory_restore_s=mem_restore,
        disk_restore_s=disk_restore,
        detect_s=_median(detects),
        restart_s=max(0.0, _median(restarts) - restore_used),
        overhead_fraction=max(0.0, (in_attempts - running) / running) if running else 0.0,
    )


def run_spec(costs: RunCosts, *, gpus_per_node: int | None = None) -> JobSpec:
    """The run as a :class:`JobSpec`: same work and costs, interruptions restarting in place
    (no node loss), no spares, and the interruption rate at which the model expects as many
    interruptions as the run had (method of moments)."""
    step = costs.step_s
    o = costs.overhead_fraction
    mem_every = costs.memory_every_steps
    memory = None
    if mem_every and costs.memory_restore_s is not None:
        memory = Tier(
            interval_s=mem_every * step,
            stall_s=min(costs.memory_stall_s, mem_every * step),
            commit_s=0.0,
            restore_s=costs.memory_restore_s,
        )
    disk_every = costs.disk_every_steps or max(costs.steps, 1)
    disk_interval = disk_every * step
    disk_stall = costs.disk_stall_s if memory is not None else costs.memory_stall_s
    if memory is not None:
        disk_stall = max(disk_stall, memory.stall_s)
    disk = Tier(
        interval_s=disk_interval,
        stall_s=min(disk_stall, disk_interval),
        commit_s=costs.disk_commit_s,
        restore_s=costs.disk_restore_s if costs.disk_restore_s is not None else 0.0,
    )
    # stalls that fall inside the measured step times are already in the work: the overhead
    # is what the attempts' wall time holds beyond steps and stalls
    stall_frac = (memory.stall_s / memory.interval_s) if memory else disk.stall_s / disk_interval
    mtti = costs.exposed_s / costs.failures if costs.failures else 1e12
    spec = JobSpec(
        gpus=costs.world_size,
        gpus_per_node=gpus_per_node or costs.world_size,
        mtti_s=mtti,
        work_s=costs.productive_s,
        step_s=step,
        memory=memory,
        disk=disk,
        peer_replication=False,
        restart_s=costs.restart_s,
        detect_s=costs.detect_s,
        startup_s=costs.startup_s,
        spares=0,
        node_loss_fraction=0.0,
        overhead_fraction=max(0.0, o - stall_frac),
    )
    return fit_rate(spec, costs.failures)
