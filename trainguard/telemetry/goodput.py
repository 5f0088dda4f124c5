"""Goodput accounting: productive vs lost wall time by cause, and ETTR, from a run's records.

Inputs are the lifecycle events (``events.jsonl``) and the step records of the workers. The
wall clock of the job (``launch`` → ``job_finished`` or the last record) is split into:

- ``productive``: step time of steps done for the first time (on the lowest rank present);
- ``recomputed_steps``: step time of steps that had already been done before a restart;
- ``startup``: launch → first step of the first attempt, less its rendezvous;
- ``rendezvous``: time agents spent in rendezvous rounds;
- ``checkpoint_stall``: time training was blocked by checkpoint saves;
- ``hang``: last step end → detection, for failures caused by a hang;
- ``restart``: last step end → failure detection (other causes), plus failure → first step of
  the next attempt, less that attempt's rendezvous;
- ``other``: the rest (data loading, logging, evaluation between steps...).

ETTR (effective training time ratio) = productive / wall time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.telemetry.contract import LOSS_CAUSES

__all__ = ["Goodput", "compute_goodput"]


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


def _is_hang(ev: Mapping[str, Any]) -> bool:
    return "hang" in str(ev.get("kind", "")) or "hang" in str(ev.get("cause", ""))


def compute_goodput(
    events: Iterable[Mapping[str, Any]],
    records: Iterable[Mapping[str, Any]],
    *,
    now: float | None = None,
) -> Goodput:
    """Split the job's wall time; ``now`` ends a job that has not finished yet."""
    evs = sorted(events, key=lambda e: float(e.get("time", 0.0)))
    steps_all = [r for r in records if r.get("kind") == "step" and "step_time_s" in r]
    logs = [r for r in records if r.get("kind") == "log"]
    g = Goodput()
    if not steps_all and not evs:
        return g
    ref = min((int(r.get("rank", 0)) for r in steps_all), default=0)
    steps = sorted(
        (r for r in steps_all if int(r.get("rank", 0)) == ref), key=lambda r: float(r["time"])
    )

    launches = [float(e["time"]) for e in evs if e.get("kind") == "launch"]
    t0 = min(launches) if launches else None
    if t0 is None and steps:
        t0 = float(steps[0]["time"]) - float(steps[0]["step_time_s"])
    if t0 is None:
        t0 = float(evs[0]["time"])
    finished = [float(e["time"]) for e in evs if e.get("kind") == "job_finished"]
    last = max(
        [float(e["time"]) for e in evs] + [float(r["time"]) for r in steps] + [t0],
    )
    t_end = max(finished) if finished else (now if now is not None else last)
    g.total_s = max(0.0, t_end - t0)

    # productive vs recomputed
    max_done = -1
    for r in steps:
        dt = float(r["step_time_s"])
        n = int(r.get("step", 0))
        if n <= max_done:
            g.lost_s["recomputed_steps"] += dt
            g.num_recomputed_steps += 1
        else:
            g.productive_s += dt
            max_done = n

    # rendezvous, per attempt
    rdzv: dict[int, float] = {}
    for e in evs:
        if e.get("kind") == "rendezvous":
            a = int(e.get("attempt", 0))
            rdzv[a] = rdzv.get(a, 0.0) + float(e.get("duration_s") or 0.0)
    g.lost_s["rendezvous"] = sum(rdzv.values())

    # checkpoint stalls (events of the reference rank or of no rank, and log records)
    for e in evs:
        if str(e.get("kind", "")).startswith("checkpoint") and e.get("rank", ref) == ref:
            g.lost_s["checkpoint_stall"] += float(e.get("stall_s") or 0.0)
    for r in logs:
        if int(r.get("rank", 0)) == ref:
            g.lost_s["checkpoint_stall"] += float(r.get("checkpoint_stall_s") or 0.0)

    first_start: dict[int, float] = {}
    last_end_in: dict[int, list[float]] = {}
    for r in steps:
        a = int(r.get("attempt", 0))
        start = float(r["time"]) - float(r["step_time_s"])
        first_start.setdefault(a, start)
        last_end_in.setdefault(a, []).append(float(r["time"]))
    if first_start:
        a0 = min(first_start)
        g.lost_s["startup"] = max(0.0, first_start[a0] - t0 - rdzv.get(a0, 0.0))

    # failures: group by attempt
    failed: dict[int, list[Mapping[str, Any]]] = {}
    for e in evs:
        if e.get("kind") in ("worker_failed", "worker_group_unhealthy") or _is_hang(e):
            failed.setdefault(int(e.get("attempt", 0)), []).append(e)
    for a, fevs in sorted(failed.items()):
        t_fail = min(float(e["time"]) for e in fevs)
        ends = [t for t in last_end_in.get(a, []) if t <= t_fail]
        prev = max(ends) if ends else first_start.get(a, t_fail)
        cause = "hang" if any(_is_hang(e) for e in fevs) else "restart"
        g.lost_s[cause] += max(0.0, t_fail - prev)
        later = [first_start[b] for b in first_start if b > a]
        t_next = min(later) if later else t_end
        rd = sum(v for b, v in rdzv.items() if b > a and first_start.get(b, t_end) <= t_next)
        g.lost_s["restart"] += max(0.0, t_next - t_fail - rd)

    accounted = g.productive_s + sum(v for k, v in g.lost_s.items() if k != "other")
    g.lost_s["other"] = max(0.0, g.total_s - accounted)
    return g
