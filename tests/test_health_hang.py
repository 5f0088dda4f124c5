"""Hang detection: HangTracker logic, and real 2-process jobs with a frozen or stuck rank."""

from __future__ import annotations

from pathlib import Path

from tests.health_fixtures.jobs import events, job_env, run_job
from trainguard.core.config.health import HealthConfig
from trainguard.core.progress import ProgressSnapshot
from trainguard.health.hang import HangTracker


def snap(
    rank: int, *, step: int, num: int, start: float, end: float, beat: float
) -> ProgressSnapshot:
    return ProgressSnapshot(rank, step, start, 0.1, beat, 1000 + rank, num, end)


def test_auto_timeout_is_max_of_minimum_and_steps() -> None:
    t = HangTracker(HealthConfig(hang_min_timeout_s=60, hang_step_factor=5, hang_warmup_steps=2))
    assert t.step_timeout() is None  # warming up
    for n in range(1, 10):
        t._learn({0: ProgressSnapshot(0, n, 0.0, 30.0 if n > 2 else 500.0, 0, 1, n, 0)})
    assert t.median_step_s == 30.0  # warm-up steps (500 s) ignored
    assert t.step_timeout() == 150.0
    t2 = HangTracker(HealthConfig(hang_timeout_s=7))
    assert t2.step_timeout() == 7


def test_frozen_vs_waiting() -> None:
    cfg = HealthConfig(hang_timeout_s=5)
    t = HangTracker(cfg, heartbeat_interval_s=1.0)
    now = 1000.0
    t.reset(now - 100)
    # rank 1 frozen mid-step 10 (stale heartbeat); rank 0 in step 10 waiting, heartbeat fresh.
    frozen = {
        0: snap(0, step=10, num=10, start=now - 6, end=now - 6.1, beat=now - 0.5),
        1: snap(1, step=10, num=10, start=now - 6, end=now - 6.1, beat=now - 6),
    }
    v = t.observe(frozen, now)
    assert v is not None and v.kind == "frozen" and v.ranks == [1] and v.waiting == [0]
    assert "rank(s) 1 frozen (heartbeat stale" in v.message
    assert t.observe(frozen, now - 2) is None  # not yet past the timeout

    # rank 1 alive between steps (stuck after step 9), rank 0 waits in step 10's collective.
    waiting = {
        0: snap(0, step=10, num=10, start=now - 6, end=now - 6.1, beat=now - 0.2),
        1: snap(1, step=9, num=10, start=0.0, end=now - 6.1, beat=now - 0.3),
    }
    v = HangTracker(cfg).observe(waiting, now)
    assert v is not None and v.kind == "waiting_for" and v.ranks == [1] and v.waiting == [0]
    assert "waiting in a collective for rank 1" in v.message

    # both wait in the same step with fresh heartbeats: the culprit is elsewhere
    both = {r: snap(r, step=4, num=4, start=now - 9, end=now - 9.1, beat=now) for r in (0, 1)}
    v = HangTracker(cfg).observe(both, now)
    assert v is not None and v.kind == "collective" and v.ranks == [0, 1]


def test_alive_between_steps_gets_idle_timeout() -> None:
    cfg = HealthConfig(hang_timeout_s=5, hang_idle_timeout_s=600)
    now = 1000.0
    evaluating = {r: snap(r, step=4, num=5, start=0.0, end=now - 60, beat=now) for r in (0, 1)}
    assert HangTracker(cfg).observe(evaluating, now) is None
    assert HangTracker(cfg).observe(evaluating, now + 600) is not None


def test_sigstopped_rank_is_named_stacks_dumped_and_job_recovers(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    p = run_job(
        run_dir,
        ["--steps", "25", "--stop-rank", "1", "--stop-at-step", "8"],
        env=job_env(hang_timeout_s=5),
        max_restarts=1,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    stopped_at = float((run_dir / "stopped_at").read_text())
    [hang] = events(run_dir, "hang_detected")
    assert hang["ranks"] == [1] and hang["hang_kind"] == "frozen"
    assert hang["waiting_ranks"] == [0]
    assert f"on node {hang['node']}" in hang["message"] and "rank(s) 1 frozen" in hang["message"]
    latency = hang["time"] - stopped_at
    assert 4.5 <= latency <= 5 + 2, latency
    [stacks] = events(run_dir, "hang_stacks")
    assert sorted(stacks["stacks"]) == ["0", "1"]
    for r in ("0", "1"):
        s = stacks["stacks"][r]
        assert s["method"] in ("py-spy", "faulthandler"), s
        assert "main" in s["stack"] and Path(s["path"]).is_file()
    assert (
        "all_reduce" in stacks["stacks"]["0"]["stack"] or "wait" in stacks["stacks"]["0"]["stack"]
    )
    assert events(run_dir, "hang_killed")[0]["ranks"] == [0, 1]
    assert len(events(run_dir, "restart")) == 1
    assert (run_dir / "done").read_text() == "1"
    assert events(run_dir, "job_finished")[-1]["state"] == "succeeded"


def test_rank_stuck_outside_collective_is_named_from_fresh_heartbeats(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    p = run_job(
        run_dir,
        ["--steps", "20", "--spin-rank", "0", "--spin-at-step", "6"],
        env=job_env(hang_timeout_s=4, stack_dump="false"),
        max_restarts=0,
    )
    assert p.returncode != 0
    [hang] = events(run_dir, "hang_detected")
    assert (
        hang["hang_kind"] == "waiting_for" and hang["ranks"] == [0] and hang["waiting_ranks"] == [1]
    )
    assert "waiting in a collective for rank 0" in hang["message"]
    assert not events(run_dir, "hang_stacks")
    failed = events(run_dir, "worker_failed")
    assert {e["rank"] for e in failed} == {0, 1} and {e["signal"] for e in failed} == {"SIGKILL"}
    assert events(run_dir, "job_finished")[-1]["state"] == "failed"


def test_faulthandler_fallback_dumps_a_stopped_process(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    from trainguard.health.stacks import dump_stacks, faulthandler_path

    code = (
        "import sys, time\n"
        "from trainguard.health.stacks import register_stack_dump\n"
        f"f = register_stack_dump({str(tmp_path)!r}, 3, 0)\n"
        "def deep_wait():\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "deep_wait()\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.2)
        stacks = dump_stacks({3: p.pid}, run_dir=tmp_path, attempt=0, use_py_spy=False)
    finally:
        p.kill()
        p.wait(timeout=10)
    assert stacks[3]["method"] == "faulthandler"
    assert "deep_wait" in stacks[3]["stack"]
    assert faulthandler_path(tmp_path, 0, 3).is_file()
    assert "deep_wait" in Path(stacks[3]["path"]).read_text()


def test_exited_ranks_are_skipped_and_stopped_ones_named() -> None:
    cfg = HealthConfig(hang_timeout_s=5)
    now = 1000.0
    # rank 0 finished and exited (stale heartbeat); rank 1 is still saving, alive.
    snaps = {
        0: snap(0, step=99, num=100, start=0.0, end=now - 100, beat=now - 100),
        1: snap(1, step=99, num=100, start=0.0, end=now - 100, beat=now - 0.5),
    }
    states = {1000: None, 1001: "S"}
    assert HangTracker(cfg).observe(snaps, now, process_state=states.get) is None
    assert HangTracker(cfg).observe(snaps, now) is not None  # without /proc: looks frozen
    # a stopped process is frozen even while its heartbeat is still fresh
    stopped = {0: snap(0, step=5, num=5, start=now - 6, end=now - 7, beat=now - 1)}
    v = HangTracker(cfg).observe(stopped, now, process_state={1000: "T"}.get)
    assert v is not None and v.kind == "frozen" and "(process stopped)" in v.message


def test_process_state_reads_proc() -> None:
    import os

    from trainguard.health.hang import process_state

    assert process_state(os.getpid()) in ("R", "S")
    assert process_state(2**22 + 12345) is None
