"""Goodput accounting: productive vs lost wall time by cause, and ETTR, from a run's records.

Inputs are the lifecycle events (``events.jsonl``) and the step records of the workers. The
wall clock of the job (``launch`` → ``job_finished`` or the last record) is split into:

- ``productive``: step time of steps done for the first time (on the lowest rank present);
- ``recomputed_steps``: step time of steps that had already been done before a restart;
- ``startup``: launcher process start (the ``launch`` event's ``process_start``, else the
  event) → first step of the first attempt, less its rendezvous;
- ``rendezvous``: time agents spent in rendezvous rounds;
- ``checkpoint_stall``: time training was blocked by checkpoint saves;
- ``hang``: last step end → detection, for failures caused by a hang;
- ``restart``: last step end → failure detection (other causes), plus failure → first step of
  the next attempt, less that attempt's rendezvous;
- ``rollback``: a loss rollback's restore, plus the step time of the steps it discarded (done
  at or after the restored step; the ones redone then count as productive again);
- ``queue_wait``, ``prolog``, ``requeue_wait``: the scheduler's share of a ``trainguard
  sbatch`` chain (``slurm_schedule`` events, :mod:`trainguard.slurm.accounting`): the first
  allocation's wait from submission to start (the wall time then starts at the submission),
  each allocation's start → its agent, and the gap between an allocation's end (a requeue, a
  resubmission) and the next start (taken out of ``other``, else ``restart``, where the
  accounting above had put it);
- ``other``: the rest (data loading, logging, evaluation between steps...).

ETTR (effective training time ratio) = productive / wall time.

The telemetry (live gauges, the report, the run summary) and the goodput planner's reader of a
finished run (``trainguard.plan.fromrun``) both count productive time, failures and hangs
here, so they agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.core.contracts.event_kinds import (
    JOB_FINISHED,
    RENDEZVOUS,
    SLURM_SCHEDULE,
    WORKER_FAILED,
    WORKER_GROUP_UNHEALTHY,
)
from trainguard.core.contracts.metrics import LOSS_CAUSES
from trainguard.core.events import launch_time

__all__ = ["Goodput", "GoodputTracker", "compute_goodput", "failures_by_attempt", "is_hang"]


@dataclass(slots=True)
class Goodput:
    total_s: float = 0.0
    productive_s: float = 0.0
    lost_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOSS_CAUSES, 0.0))
    num_recomputed_steps: int = 0

    @property
    def ettr(self) -> float | None:
        return self.productive_s / self.total_s if self.total_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_s": self.total_s,
            "productive_s": self.productive_s,
            "lost_s": dict(self.lost_s),
            "ettr": self.ettr,
            "num_recomputed_steps": self.num_recomputed_steps,
        }


def is_hang(ev: Mapping[str, Any]) -> bool:
    """Whether an event reports a hang (a hang event, or a worker failure caused by one)."""
    return "hang" in str(ev.get("kind", "")) or "hang" in str(ev.get("cause", ""))


def failures_by_attempt(
    events: Iterable[Mapping[str, Any]],
) -> dict[int, list[Mapping[str, Any]]]:
    """The events that end an attempt in failure (a worker failed, the group went unhealthy,
    a hang), by attempt."""
    failed: dict[int, list[Mapping[str, Any]]] = {}
    for e in events:
        if e.get("kind") in (WORKER_FAILED, WORKER_GROUP_UNHEALTHY) or is_hang(e):
            failed.setdefault(int(e.get("attempt", 0)), []).append(e)
    return failed


class GoodputTracker:
    """Incremental form: feed one rank's records in file order with :meth:`add`, then call
    :meth:`result` with the events. Memory stays constant per attempt, not per step."""

    def __init__(self) -> None:
        self.productive_s = 0.0
        self.recomputed_s = 0.0
        self.num_recomputed = 0
        self.max_done = -1
        self.first_start: dict[int, float] = {}
        self.last_end: dict[int, float] = {}
        self.first_step_start: float | None = None
        self.last_time: float | None = None
        self.logged_stall: float | None = None
        self.rollback_s = 0.0
        self._productive: dict[int, float] = {}  # step -> time, the newest steps (rollbacks)

    _KEEP = 100_000
    """Productive steps remembered for a rollback to take back (older ones stay productive)."""

    def add(self, r: Mapping[str, Any]) -> None:
        kind = r.get("kind")
        if kind == "log":
            v = r.get("checkpoint_stall_s")
            if isinstance(v, int | float) and not isinstance(v, bool):
                self.logged_stall = (self.logged_stall or 0.0) + float(v)
            if "rollback_to" in r:
                self._rolled_back(int(r["rollback_to"]), float(r.get("rollback_s") or 0.0))
            return
        if kind != "step" or "step_time_s" not in r or r.get("failed"):
            return
        dt = float(r["step_time_s"])
        end = float(r["time"])
        start = end - dt
        n = int(r.get("step", 0))
        if n <= self.max_done:
            self.recomputed_s += dt
            self.num_recomputed += 1
        else:
            self.productive_s += dt
            self.max_done = n
            self._productive[n] = dt
            if len(self._productive) > self._KEEP:
                del self._productive[next(iter(self._productive))]
        a = int(r.get("attempt", 0))
        self.first_start.setdefault(a, start)
        self.last_end[a] = max(self.last_end.get(a, end), end)
        if self.first_step_start is None:
            self.first_step_start = start
        self.last_time = end if self.last_time is None else max(self.last_time, end)

    def _rolled_back(self, restored: int, restore_s: float) -> None:
        """Steps at or after ``restored`` were discarded: their time is the rollback's."""
        lost = [n for n in self._productive if n >= restored]
        for n in lost:
            dt = self._productive.pop(n)
            self.productive_s -= dt
            self.rollback_s += dt
        self.rollback_s += restore_s
        self.max_done = min(self.max_done, restored - 1)

    def _stall(self, evs: list[Mapping[str, Any]]) -> float:
        """Checkpoint stalls: the rank's log records, else events of rank 0 or of no rank."""
        if self.logged_stall is not None:
            return self.logged_stall
        return sum(
            float(e.get("stall_s") or 0.0)
            for e in evs
            if str(e.get("kind", "")).startswith("checkpoint") and e.get("rank", 0) == 0
        )

    def result(self, events: Iterable[Mapping[str, Any]], *, now: float | None = None) -> Goodput:
        evs = sorted(events, key=lambda e: float(e.get("time", 0.0)))
        g = Goodput()
        if self.first_step_start is None and not evs:
            return g
        # the launcher's own start-up (interpreter, imports) is wall time of the job too
        launched = launch_time(evs)
        if launched is not None:
            t0 = launched
        elif self.first_step_start is not None:
            t0 = self.first_step_start
        else:
            t0 = float(evs[0]["time"])
        finished = [float(e["time"]) for e in evs if e.get("kind") == JOB_FINISHED]
        last = max([float(e["time"]) for e in evs] + [self.last_time or t0, t0])
        t_end = max(finished) if finished else (now if now is not None else last)
        g.total_s = max(0.0, t_end - t0)
        restarts_iv: list[tuple[float, float]] = []
        g.productive_s = self.productive_s
        g.lost_s["recomputed_steps"] = self.recomputed_s
        g.lost_s["rollback"] = self.rollback_s
        g.num_recomputed_steps = self.num_recomputed

        rdzv: dict[int, float] = {}
        for e in evs:
            if e.get("kind") == RENDEZVOUS:
                a = int(e.get("attempt", 0))
                rdzv[a] = rdzv.get(a, 0.0) + float(e.get("duration_s") or 0.0)
        g.lost_s["rendezvous"] = sum(rdzv.values())

        g.lost_s["checkpoint_stall"] = self._stall(evs)

        first_start = self.first_start
        failed = failures_by_attempt(evs)
        t_failed = {a: min(float(e["time"]) for e in fevs) for a, fevs in failed.items()}
        if first_start:
            a0 = min(first_start)
            g.lost_s["startup"] = max(0.0, first_start[a0] - t0 - rdzv.get(a0, 0.0))
        elif t_failed:  # no step was ever done: start-up until the first failure
            a0 = min(t_failed)
            g.lost_s["startup"] = max(0.0, min(t_failed[a0], t_end) - t0 - rdzv.get(a0, 0.0))

        for a, fevs in sorted(failed.items()):
            t_fail = min(t_failed[a], t_end)
            end = self.last_end.get(a)
            prev = end if end is not None and end <= t_fail else first_start.get(a, t_fail)
            cause = "hang" if any(is_hang(e) for e in fevs) else "restart"
            g.lost_s[cause] += max(0.0, t_fail - prev)
            # the failure's cost ends at the next attempt's first step, else at its own failure
            # (an attempt that failed before any step), else at the end of the job: the
            # intervals of successive failures never overlap
            nxt = [(first_start[b], b) for b in first_start if b > a]
            nxt += [(t_failed[b], b) for b in t_failed if b > a and b not in first_start]
            t_next, b_next = min(nxt) if nxt else (t_end, None)
            t_next = min(t_next, t_end)
            rd = sum(v for b, v in rdzv.items() if a < b and (b_next is None or b <= b_next))
            g.lost_s["restart"] += max(0.0, t_next - t_fail - rd)
            restarts_iv.append((t_fail, t_next))

        # the scheduler's share (trainguard sbatch), its intervals inside [t0, t_end] once
        _not_twice(g, _scheduler_share(g, evs, t0), restarts_iv)
        accounted = g.productive_s + sum(v for k, v in g.lost_s.items() if k != "other")
        g.lost_s["other"] = max(0.0, g.total_s - accounted)
        return g


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def _not_twice(
    g: Goodput, sched: list[tuple[float, float]], restarts: list[tuple[float, float]]
) -> None:
    """A gap between allocations inside a failure's restart interval is the scheduler's: out
    of ``restart`` (and whatever still exceeds the wall time, out of restart, then startup)."""
    both = sum(_overlap(iv, r) for iv in sched for r in restarts)
    g.lost_s["restart"] -= min(both, g.lost_s["restart"])
    over = g.productive_s + sum(v for k, v in g.lost_s.items() if k != "other") - g.total_s
    for k in ("restart", "startup"):
        take = min(max(over, 0.0), g.lost_s[k])
        g.lost_s[k] -= take
        over -= take


def _scheduler_share(
    g: Goodput, evs: list[Mapping[str, Any]], t0: float
) -> list[tuple[float, float]]:
    """Add the ``slurm_schedule`` events' times to ``g`` (the first allocation's queue wait and
    prolog before ``t0`` extend the wall time); returns the intervals of the later ones (the
    previous allocation's end → this allocation's agent)."""
    seen: dict[tuple[str, Any], Mapping[str, Any]] = {}
    for e in evs:
        if e.get("kind") == SLURM_SCHEDULE and isinstance(e.get("start"), int | float):
            seen.setdefault((str(e.get("job_id")), e.get("restart")), e)
    runs = sorted(seen.values(), key=lambda e: float(e["start"]))
    inside: list[tuple[float, float]] = []
    for i, e in enumerate(runs):
        start = float(e["start"])
        submit = e.get("submit")
        if i == 0 and e.get("requeue_gap_s") is None and isinstance(submit, int | float):
            before = max(0.0, t0 - float(submit))  # submission → launch: outside the events
            g.total_s += before
            g.lost_s["queue_wait"] += max(0.0, min(start, t0) - float(submit))
            g.lost_s["prolog"] += max(0.0, t0 - max(start, float(submit)))
            continue
        span = [start, start]
        for cause, key, side in (("requeue_wait", "requeue_gap_s", 0), ("prolog", "prolog_s", 1)):
            v = e.get(key)
            if isinstance(v, int | float) and v > 0:
                g.lost_s[cause] += float(v)
                span[side] += float(v) * (1 if side else -1)
        inside.append((span[0], span[1]))
    return inside


def compute_goodput(
    events: Iterable[Mapping[str, Any]],
    records: Iterable[Mapping[str, Any]],
    *,
    now: float | None = None,
) -> Goodput:
    """Split the job's wall time (records of the lowest rank present count); ``now`` ends a
    job that has not finished yet."""
    recs = [r for r in records if r.get("kind") in ("step", "log")]
    ranks = [int(r.get("rank", 0)) for r in recs if r.get("kind") == "step"]
    ref = min(ranks, default=0)
    tracker = GoodputTracker()
    mine = [r for r in recs if int(r.get("rank", 0)) == ref]
    for r in sorted(mine, key=lambda r: float(r.get("time", 0.0))):
        tracker.add(r)
    return tracker.result(events, now=now)
