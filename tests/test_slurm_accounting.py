"""The scheduler's share of a trainguard sbatch chain without a cluster: sacct's and scontrol's
output as Slurm 22.05 prints it, the fallbacks when sacct is missing or fails (counted
warnings, never an error), and the goodput breakdown that adds the scheduler's times up to the
wall time. The real cluster's counterpart: test_preemption_saves_requeues_and_resumes in
test_slurm_cluster.py."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from trainguard.core.goodput import compute_goodput
from trainguard.slurm.accounting import (
    parse_sacct,
    parse_scontrol_job,
    parse_time,
    run_command,
    schedule,
)
from trainguard.slurm.cli import parse_scontrol_record
from trainguard.telemetry.summary import scheduler_lines


def _t(s: str) -> float:
    return time.mktime(time.strptime(s, "%Y-%m-%dT%H:%M:%S"))


# sacct -X --duplicates --parsable2 --noheader --format=JobIDRaw,State,Submit,Eligible,Start,End
# (a requeued job: its first run REQUEUED, the second RUNNING; a job cancelled while pending;
# a step line, which -X leaves out but a site's sacct wrapper may not)
SACCT = """\
41|REQUEUED|2026-12-04T00:51:02|2026-12-04T00:51:02|2026-12-04T00:51:05|2026-12-04T00:52:10
41|RUNNING|2026-12-04T00:52:10|2026-12-04T00:52:21|2026-12-04T00:52:23|Unknown
41.batch|RUNNING|2026-12-04T00:52:23|2026-12-04T00:52:23|2026-12-04T00:52:23|Unknown
43|CANCELLED by 0|2026-12-04T00:55:00|2026-12-04T00:55:00|None|2026-12-04T00:55:04
"""

# scontrol show job -o 41 (abridged; Slurm 22.05), the run after a requeue
SCONTROL = (
    "JobId=41 JobName=trainguard-train_mlp UserId=root(0) GroupId=root(0) MCS_label=N/A "
    "Priority=4294901757 Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None "
    "Dependency=(null) Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=0:0 "
    "RunTime=00:00:04 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-04T00:52:10 "
    "EligibleTime=2026-12-04T00:52:21 AccrueTime=2026-12-04T00:52:21 "
    "StartTime=2026-12-04T00:52:23 EndTime=Unknown Deadline=N/A PreemptEligibleTime=2026-12-04T00:52:23 "
    "PreemptTime=None SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-12-04T00:52:23 "
    "Scheduler=Main Partition=debug AllocNode:Sid=host:1234 NodeList=node[1-3] BatchHost=node1"
)


def test_parse_sacct_and_times() -> None:
    runs = parse_sacct(SACCT)
    assert [(r.job_id, r.state) for r in runs] == [
        ("41", "REQUEUED"), ("41", "RUNNING"), ("43", "CANCELLED")]  # fmt: skip
    assert runs[0].end == _t("2026-12-04T00:52:10") and runs[1].end is None
    assert runs[1].eligible - runs[1].submit == 11.0  # the requeue's hold (cred_expire + 1)
    assert runs[2].start is None
    assert parse_time("1764809462") == 1764809462.0  # SLURM_TIME_FORMAT=%s
    assert parse_time("Unknown") is None and parse_time("garbage") is None
    assert parse_sacct("") == [] and parse_sacct("sacct: error: x\n") == []


def test_parse_scontrol_job() -> None:
    r = parse_scontrol_job(parse_scontrol_record(SCONTROL))
    assert r is not None and r.job_id == "41" and r.state == "RUNNING"
    assert r.start == _t("2026-12-04T00:52:23") and r.end is None
    assert parse_scontrol_job({}) is None


class Cmds:
    """Answers of the Slurm commands: text, or an exception to raise."""

    def __init__(self, **answers: object) -> None:
        self.answers = answers
        self.calls: list[str] = []

    def __call__(self, argv: Sequence[str]) -> str:
        self.calls.append(argv[0])
        a = self.answers.get(argv[0])
        if isinstance(a, Exception):
            raise a
        if a is None:
            raise RuntimeError(f"{argv[0]} not found")
        return str(a)


def test_schedule_from_sacct_after_a_requeue() -> None:
    launch = _t("2026-12-04T00:52:25")
    run = Cmds(sacct=SACCT)
    s = schedule("41", launch=launch, events=[], run=run)
    assert run.calls == ["sacct"]
    assert s["source"] == "sacct" and s["warnings"] == []
    assert s["queue_wait_s"] == 13.0 and s["prolog_s"] == 2.0
    assert s["requeue_gap_s"] == 13.0  # the REQUEUED run's end -> this start


def test_schedule_falls_back_to_scontrol_with_a_counted_warning() -> None:
    launch = _t("2026-12-04T00:52:25")
    finish = {"kind": "slurm_finish", "action": "requeue", "time": _t("2026-12-04T00:52:09")}
    run = Cmds(sacct=RuntimeError("sacct: error: Slurm accounting storage is disabled"),
               scontrol=SCONTROL + "\n")  # fmt: skip
    s = schedule("41", launch=launch, events=[finish], run=run)
    assert s["source"] == "scontrol" and len(s["warnings"]) == 1
    assert "accounting storage is disabled" in s["warnings"][0]
    assert s["queue_wait_s"] == 13.0 and s["requeue_gap_s"] == 14.0
    # the first allocation of a chain: no gap
    s0 = schedule("41", launch=launch, events=[], run=run)
    assert "requeue_gap_s" not in s0 and s0["queue_wait_s"] == 13.0
    # sacct answers nothing about the job (an empty database): scontrol's answer
    s1 = schedule("41", launch=launch, events=[], run=Cmds(sacct="", scontrol=SCONTROL))
    assert s1["source"] == "scontrol" and "no record of job 41" in s1["warnings"][0]


def test_schedule_with_no_slurm_commands_warns_and_returns() -> None:
    s = schedule("41", launch=time.time(), events=[], run=Cmds())
    assert s["source"] is None and "queue_wait_s" not in s
    assert [w.split(":")[0] for w in s["warnings"]] == ["sacct", "scontrol show job"]
    # the real runner: a command that is not there is one line, not a traceback
    with pytest.raises(RuntimeError, match="not found"):
        run_command(["trainguard-no-such-sacct"])


def test_resubmitted_job_gap_from_the_job_before() -> None:
    text = (
        "50|FAILED|2026-12-04T01:00:00|2026-12-04T01:00:00|2026-12-04T01:00:01|2026-12-04T01:02:00\n"
        "57|RUNNING|2026-12-04T01:02:00|2026-12-04T01:02:00|2026-12-04T01:02:07|Unknown\n"
    )
    resub = {
        "kind": "resubmit",
        "job_id": "50",
        "new_job_id": "57",
        "time": _t("2026-12-04T01:01:59"),
    }
    s = schedule("57", launch=_t("2026-12-04T01:02:08"), events=[resub], run=Cmds(sacct=text))
    assert s["queue_wait_s"] == 7.0 and s["requeue_gap_s"] == 7.0 and s["prolog_s"] == 1.0


def _ev(kind: str, t: float, **kw: object) -> dict:
    return {"kind": kind, "time": t, "node": "node1", "attempt": 0, **kw}


def test_goodput_holds_the_schedulers_share_and_adds_up(tmp_path: Path) -> None:
    # allocation 1: submitted at 0, started at 5, agent at 6, steps 10-30, requeued at 31;
    # allocation 2: started at 45 (gap 14), agent at 46, steps 50-60, finished at 61
    events = [
        _ev("launch", 6.0, process_start=6.0),
        _ev("slurm_schedule", 8.0, job_id="41", restart=0, submit=0.0, start=5.0, launch=6.0,
            queue_wait_s=5.0, prolog_s=1.0),
        _ev("job_finished", 31.0, state="requeue"),
        _ev("launch", 46.0, process_start=46.0),
        _ev("slurm_schedule", 47.0, job_id="41", restart=1, submit=31.0, start=45.0,
            launch=46.0, queue_wait_s=14.0, prolog_s=1.0, requeue_gap_s=14.0),
        _ev("job_finished", 61.0, state="succeeded"),
    ]  # fmt: skip
    steps = [{"kind": "step", "rank": 0, "step": i, "time": 11.0 + i, "step_time_s": 1.0}
             for i in range(20)]  # fmt: skip
    steps += [{"kind": "step", "rank": 0, "step": 20 + i, "time": 51.0 + i, "step_time_s": 1.0,
               "attempt": 0} for i in range(10)]  # fmt: skip
    g = compute_goodput(events, steps)
    assert g.total_s == 61.0  # from the submission, not the first launch
    assert g.lost_s["queue_wait"] == 5.0 and g.lost_s["prolog"] == 2.0
    assert g.lost_s["requeue_wait"] == 14.0
    assert g.productive_s + sum(g.lost_s.values()) == pytest.approx(g.total_s)
    # the summary's line per allocation
    lines = scheduler_lines(events)
    assert lines[1] == ("  Slurm job 41 restart 1: queue wait 14.0 s, prolog 1.0 s, since the "
                        "previous allocation 14.0 s (no scheduler times)")  # fmt: skip


def test_goodput_gap_counted_as_a_restart_is_not_counted_twice() -> None:
    # a resubmission after a failure: the failure -> next step interval is a restart's too
    events = [
        _ev("launch", 0.0, process_start=0.0),
        _ev("worker_failed", 20.0, rank=0, exitcode=1),
        _ev("slurm_schedule", 40.0, job_id="57", restart=0, start=38.0, submit=25.0,
            queue_wait_s=13.0, prolog_s=1.0, requeue_gap_s=16.0),
        _ev("job_finished", 60.0, state="succeeded"),
    ]  # fmt: skip
    steps = [{"kind": "step", "rank": 0, "step": 0, "time": 10.0, "step_time_s": 1.0, "attempt": 0},
             {"kind": "step", "rank": 0, "step": 1, "time": 45.0, "step_time_s": 1.0, "attempt": 1}]  # fmt: skip
    g = compute_goodput(events, steps)
    assert g.lost_s["requeue_wait"] == 16.0 and g.lost_s["prolog"] == 1.0
    # failure -> next step: 24 s, of which 17 s the scheduler's
    assert g.lost_s["restart"] == pytest.approx(24.0 + 10.0 - 17.0)
    assert g.productive_s + sum(g.lost_s.values()) == pytest.approx(g.total_s)


def test_sacct_missing_from_path_is_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm commands there
    s = schedule("41", launch=time.time(), events=[])
    assert s["source"] is None
    assert s["warnings"] == ["sacct: sacct not found", "scontrol show job: scontrol not found"]
