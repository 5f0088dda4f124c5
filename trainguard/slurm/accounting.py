"""The scheduler's share of a ``trainguard sbatch`` chain's wall time, per allocation (the
job's first start, each start after a requeue, each resubmitted job's start):

- ``queue_wait_s``: Slurm's ``Submit`` → ``Start`` of the allocation (after a requeue Slurm
  resets the submit time to the requeue);
- ``prolog_s``: ``Start`` → the start of the batch host's trainguard agent (the node prolog,
  the batch script, ``srun``'s step launch);
- ``requeue_gap_s`` (every allocation after the first): the end of the previous allocation →
  this ``Start``; the previous end is ``sacct``'s ``End`` of the run before (a requeued run of
  the same job, or the job this one was resubmitted from), else the time of the previous
  allocation's ``slurm_finish`` event (its batch script requeued or resubmitted right then).

The times come from ``sacct -X --duplicates`` (Slurm's accounting: every run of a requeued job,
with its end) where it answers; where ``sacct`` is missing or fails (no ``slurmdbd``: "Slurm
accounting storage is disabled") from ``scontrol show job`` (the current run's ``SubmitTime``,
``EligibleTime`` and ``StartTime``) and the run's events. Each failure is a counted warning in
the ``slurm_schedule`` event; nothing here ever stops a job.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.slurm.cli import parse_scontrol_record

__all__ = [
    "SACCT_FORMAT",
    "SchedRun",
    "parse_sacct",
    "parse_scontrol_job",
    "parse_time",
    "schedule",
]

SACCT_FORMAT = "JobIDRaw,State,Submit,Eligible,Start,End"
"""``sacct --format`` of :func:`parse_sacct` (``--parsable2 --noheader``: ``|``-separated)."""

_NO_TIME = {"", "unknown", "none", "n/a", "(null)"}


def parse_time(text: str) -> float | None:
    """A Slurm time (``2026-12-04T00:51:02`` in the local time zone, as sacct and scontrol
    print it, or seconds since the epoch with ``SLURM_TIME_FORMAT=%s``); None for
    ``Unknown`` / ``None``."""
    s = text.strip()
    if s.lower() in _NO_TIME:
        return None
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return float(s)
    try:
        return time.mktime(time.strptime(s, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class SchedRun:
    """One run of a Slurm job (a requeued job has one per start)."""

    job_id: str
    state: str
    submit: float | None
    eligible: float | None
    start: float | None
    end: float | None


def parse_sacct(text: str) -> list[SchedRun]:
    """``sacct -X --duplicates --parsable2 --noheader --format=`` :data:`SACCT_FORMAT`: one
    run per line, in sacct's order (steps, ``JOB.batch``, are left out)."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 6 or not parts[0] or "." in parts[0]:
            continue
        job, state, submit, eligible, start, end = parts[:6]
        out.append(
            SchedRun(
                job_id=job.strip(),
                state=state.split()[0].upper() if state.strip() else "",
                submit=parse_time(submit),
                eligible=parse_time(eligible),
                start=parse_time(start),
                end=parse_time(end),
            )
        )
    return out


def parse_scontrol_job(record: Mapping[str, str]) -> SchedRun | None:
    """The current run of a job from ``scontrol show job -o`` (:func:`parse_scontrol_record`)."""
    if not record.get("JobId"):
        return None
    return SchedRun(
        job_id=record["JobId"],
        state=record.get("JobState", "").upper(),
        submit=parse_time(record.get("SubmitTime", "")),
        eligible=parse_time(record.get("EligibleTime", "")),
        start=parse_time(record.get("StartTime", "")),
        end=parse_time(record.get("EndTime", "")),
    )


Runner = Callable[[Sequence[str]], str]
"""Runs a Slurm command, returns its stdout; raises on a failure (the message says why)."""


def run_command(argv: Sequence[str], timeout_s: float = 20.0) -> str:
    """The default :data:`Runner`: the command's stdout, or RuntimeError with its first error
    line."""
    try:
        p = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except FileNotFoundError:
        raise RuntimeError(f"{argv[0]} not found") from None
    except OSError as e:  # not runnable
        raise RuntimeError(f"{argv[0]}: {e.strerror or e}") from None
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{argv[0]} did not answer in {timeout_s:.0f} s") from None
    if p.returncode != 0:
        lines = [x.strip() for x in (p.stderr or p.stdout).splitlines() if x.strip()]
        raise RuntimeError(lines[0] if lines else f"exit code {p.returncode}")
    return p.stdout


def _previous_job(job_id: str, events: Iterable[Mapping[str, Any]]) -> str | None:
    """The job this one was resubmitted from (its ``resubmit`` event), if any."""
    for e in events:
        if e.get("kind") == "resubmit" and str(e.get("new_job_id")) == job_id:
            return str(e.get("job_id"))
    return None


def schedule(
    job_id: str,
    *,
    launch: float,
    events: Sequence[Mapping[str, Any]],
    run: Runner = run_command,
) -> dict[str, Any]:
    """The fields of the ``slurm_schedule`` event of the running allocation of ``job_id``;
    ``launch``: when the batch host's agent started; ``events``: the run's events so far."""
    warnings: list[str] = []
    prev_job = _previous_job(job_id, events)
    ids = [job_id] + ([prev_job] if prev_job else [])
    runs: list[SchedRun] = []
    source = "sacct"
    try:
        text = run(["sacct", "-X", "--duplicates", "--parsable2", "--noheader",
                    f"--format={SACCT_FORMAT}", "-j", ",".join(ids)])  # fmt: skip
        runs = parse_sacct(text)
        if not any(r.job_id == job_id and r.start is not None for r in runs):
            raise RuntimeError(f"no record of job {job_id}")
    except Exception as e:
        warnings.append(f"sacct: {e}")
        runs = []
    current: SchedRun | None = None
    if runs:
        mine = [r for r in runs if r.job_id == job_id and r.start is not None]
        current = max(mine, key=lambda r: r.start or 0.0)
    else:
        source = "scontrol"
        try:
            current = parse_scontrol_job(
                parse_scontrol_record(
                    next(
                        (
                            x
                            for x in run(["scontrol", "show", "job", "-o", job_id]).splitlines()
                            if x.strip()
                        ),
                        "",
                    )  # fmt: skip
                )
            )
        except Exception as e:
            warnings.append(f"scontrol show job: {e}")
    out: dict[str, Any] = {"job_id": job_id, "source": source if current else None,
                           "launch": launch, "warnings": warnings}  # fmt: skip
    if current is None or current.start is None:
        return out
    start = current.start
    out.update(submit=current.submit, eligible=current.eligible, start=start)
    out["queue_wait_s"] = max(0.0, start - current.submit) if current.submit is not None else None
    out["prolog_s"] = max(0.0, launch - start)
    # the end of the allocation before this one: sacct's, else its batch script's decision
    ends = [r.end for r in runs if r.end is not None and r.end <= start and r is not current]
    finishes = [float(e["time"]) for e in events
                if e.get("kind") == "slurm_finish" and float(e.get("time", 0)) <= start + 1.0]  # fmt: skip
    prev_end = max(ends) if ends else (max(finishes) if finishes else None)
    if prev_end is not None:
        out["previous_end"] = prev_end
        out["requeue_gap_s"] = max(0.0, start - prev_end)
    return out
