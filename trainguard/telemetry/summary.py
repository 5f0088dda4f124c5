"""The recovery summary ``trainguard run`` prints when a job ends: every failure with its rank,
cause and step, how long until the next completed step, how many steps were redone, where the
job resumed from (memory, peer memory, disk), and the run's goodput."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainguard.core.contracts.actions import RecoveryAction
from trainguard.core.contracts.event_kinds import (
    CHECKPOINT_RESTORED,
    FAILURE_ATTRIBUTED,
    HANG_DETECTED,
    JOB_FINISHED,
    LOSS_ROLLBACK,
    RECOVERY_DECISION,
    ROLE_REPLICA_FAILED,
    ROLE_RESTART_BUDGET_EXHAUSTED,
    ROLLBACK_EXHAUSTED,
    SLURM_SCHEDULE,
    WORKER_FAILED,
)
from trainguard.core.contracts.jobstate import JobState
from trainguard.core.goodput import compute_goodput
from trainguard.telemetry.report import RunData, _root_causes, load_run

__all__ = ["recovery_summary"]


def _steps(data: RunData) -> list[dict[str, Any]]:
    return sorted(
        (
            r
            for recs in data.records.values()
            for r in recs
            if r.get("kind") == "step" and not r.get("failed")  # a failed step is not done
        ),
        key=lambda r: float(r.get("time", 0.0)),
    )


def _cause(f: dict[str, Any]) -> str:
    if f.get("signal"):
        return f"killed by {f['signal']}"
    if f.get("exitcode") is not None:
        return f"exit code {f['exitcode']}"
    return str(f.get("cause") or f.get("kind"))


def recovery_summary(run_dir: str | Path) -> list[str]:
    """Lines for the console (empty when the run directory has nothing to say)."""
    data = load_run(run_dir)
    failures = [e for e in data.events if e.get("kind") in (WORKER_FAILED, HANG_DETECTED)]
    roots = _root_causes([e for e in failures if e.get("kind") == WORKER_FAILED])
    hangs = [e for e in failures if e.get("kind") == HANG_DETECTED]
    steps = _steps(data)
    restored = [e for e in data.events if e.get("kind") == CHECKPOINT_RESTORED and e.get("step")]
    lines = []
    incidents = sorted(
        [(float(f["time"]), f) for f in roots] + [(float(h["time"]), h) for h in hangs],
        key=lambda x: x[0],
    )
    verdicts = _verdicts(data.events)
    seen_attempts: set[Any] = set()
    for t, f in incidents:
        key = (f.get("attempt"), f.get("generation"))  # generation: in-process restarts
        if key in seen_attempts and f.get("kind") == WORKER_FAILED:
            continue  # one line per failed attempt: its first root cause
        seen_attempts.add(key)
        # the ranks step in lockstep; the failed rank's own last records may never have been
        # flushed, so the job's last completed step says where it failed
        before = [s for s in steps if float(s["time"]) <= t]
        done = int(before[-1]["step"]) + 1 if before else 0
        after = [s for s in steps if float(s["time"]) > t]
        resumed = next((e for e in restored if float(e["time"]) > t), None)
        what = (
            f"rank {f.get('rank')} {_cause(f)}"
            if f.get("kind") == WORKER_FAILED
            else f"hang of rank(s) {f.get('ranks') or f.get('rank')}"
        )
        line = f"  {what} after {done} step{'s' if done != 1 else ''}"
        if after:
            line += f"; next step done {float(after[0]['time']) - t:.1f} s later"
        if resumed is not None:
            redone = max(0, done - int(resumed["step"]))
            line += f"; resumed from {resumed.get('source')} at step {resumed['step']}"
            line += f" ({redone} step{'s' if redone != 1 else ''} redone)"
        if f.get("attempt") in verdicts and f.get("kind") == WORKER_FAILED:
            line += "; " + verdicts.pop(f.get("attempt"))
        lines.append(line)
    n_failures = len(lines)
    lines.extend(_other_incidents(data.events))
    lines.extend(scheduler_lines(data.events))
    lines.extend(f"  attempt {a}: {v}" for a, v in verdicts.items())
    lines.extend(_stop(data.events))
    return [_headline(data, n_failures), *lines]


def _headline(data: Any, n_failures: int) -> str:
    """The summary's first line: failures, the job's outcome, rollbacks, goodput."""
    records = [r for recs in data.records.values() for r in recs]
    g = compute_goodput(data.events, records)
    states = {e.get("state") for e in data.events if e.get("kind") == JOB_FINISHED}
    s = "s" if n_failures != 1 else ""
    if JobState.SUCCEEDED in states:
        outcome = "recovered"
    elif JobState.DO_NOT_REQUEUE in states:
        outcome = "seen; job stopped"
    elif JobState.REQUEUE in states:
        outcome = "seen; job requeued"
    elif states & {JobState.FAILED, JobState.EVICTED, JobState.EXCLUDED}:
        outcome = "seen; job failed"
    else:
        outcome = "seen"
    head = f"trainguard run: {n_failures} failure{s} {outcome}"
    if not n_failures:
        # a job can end without a worker failing: a role that cannot be kept running, a
        # node taken out; the line must not read as a clean run then
        ended = outcome.partition("; ")[2]
        head = (
            f"trainguard run: no worker failures; {ended}"
            if ended
            else "trainguard run: no failures"
        )
    n_rb = sum(1 for e in data.events if e.get("kind") == LOSS_ROLLBACK)
    if n_rb:
        head += f", {n_rb} loss rollback{'s' if n_rb != 1 else ''}"
    if g.ettr is not None:
        lost = ", ".join(f"{k} {v:.1f} s" for k, v in g.lost_s.items() if v > 0.05)
        head += f"; goodput {100 * g.ettr:.1f} % of {g.total_s:.1f} s"
        if lost:
            head += f" (lost: {lost})"
    return head


def scheduler_lines(events: list[dict[str, Any]]) -> list[str]:
    """One line per allocation of a ``trainguard sbatch`` chain: the scheduler's share."""
    lines, seen = [], set()
    for e in events:
        key = (e.get("job_id"), e.get("restart"))
        if e.get("kind") != SLURM_SCHEDULE or key in seen:
            continue
        seen.add(key)
        parts = [f"{label} {float(e[k]):.1f} s" for label, k in (
            ("queue wait", "queue_wait_s"), ("prolog", "prolog_s"),
            ("since the previous allocation", "requeue_gap_s"))
            if isinstance(e.get(k), int | float)]  # fmt: skip
        src = e.get("source") or "no scheduler times"
        warn = e.get("warnings") or []
        if warn:
            src += f"; {len(warn)} warning{'s' if len(warn) != 1 else ''}: {'; '.join(warn)}"
        lines.append(f"  Slurm job {e.get('job_id')} restart {e.get('restart', 0)}: "
                     f"{', '.join(parts) or '-'} ({src})")  # fmt: skip
    return lines


def _other_incidents(events: list[dict[str, Any]]) -> list[str]:
    """Lines for the loss rollbacks and the role replicas' failures."""
    lines = []
    for e in events:
        if e.get("kind") == LOSS_ROLLBACK:
            a, b = (e.get("skip") or [None, None])[:2]
            lines.append(
                f"  loss {e.get('reason') or 'anomaly'} at step {e.get('bad_step')}: rolled back to step "
                f"{e.get('restored_step')} in {float(e.get('duration_s') or 0):.2f} s, "
                f"skipped steps {a}-{b}"
            )
        elif e.get("kind") == ROLLBACK_EXHAUSTED:
            lines.append(
                f"  loss anomaly at step {e.get('bad_step')} after {e.get('rollbacks_here')} "
                f"rollbacks there: job stopped (exit {e.get('exitcode')}, do not requeue)"
            )
    role_failed = [e for e in events if e.get("kind") == ROLE_REPLICA_FAILED]
    for role in sorted({str(e.get("role")) for e in role_failed}):
        mine = [e for e in role_failed if str(e.get("role")) == role]
        reps = sorted({int(e.get("replica", 0)) for e in mine})
        lines.append(
            f"  {role}: {len(mine)} replica failure{'s' if len(mine) != 1 else ''} (replica"
            f"{'s' if len(reps) != 1 else ''} {','.join(map(str, reps))}), restarted alone; "
            "the trainer kept running"
        )
    for e in events:
        if e.get("kind") == ROLE_RESTART_BUDGET_EXHAUSTED:
            lines.append(f"  {e.get('message')}")
    return lines


def _verdicts(events: list[dict[str, Any]]) -> dict[Any, str]:
    """Each failed attempt's attribution (its first one): verdict, cause, what, where, ranks."""
    out: dict[Any, str] = {}
    for e in events:
        if e.get("kind") != FAILURE_ATTRIBUTED or e.get("failed_attempt") in out:
            continue
        cause, verdict = e.get("cause"), e.get("verdict")
        text = f"verdict {verdict} ({cause}"
        text += ")" if cause == "transient" else f": {e.get('summary')})"
        out[e.get("failed_attempt")] = text
    return out


def _stop(events: list[dict[str, Any]]) -> list[str]:
    """The job's stop, when the recovery policy stopped it."""
    for e in events:
        if e.get("kind") == RECOVERY_DECISION and e.get("action") == RecoveryAction.STOP:
            return [f"  job stopped (exit 93, do not requeue): {e.get('reason')}"]
    return []
