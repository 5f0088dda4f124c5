"""The worker handle and the progress channel, without and with an agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.launch_utils import REPO, base_env, launch
from trainguard.core.progress import ProgressReader, ProgressWriter, progress_path

SCRIPT = """
import trainguard
tg = trainguard.init()
for i in range(3):
    with tg.step(tokens=128, samples=4):
        pass
    tg.log(loss=1.0 / (i + 1), note="x")
print(tg.run_dir, tg.rank, tg.world_size, tg.under_agent)
tg.close()
"""


def test_plain_python_writes_run_dir(tmp_path: Path) -> None:
    env = base_env()
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    run_dir, rank, world, under = out.stdout.split()
    assert (rank, world, under) == ("0", "1", "False")
    run_dir = tmp_path / run_dir
    assert run_dir.parent.name == "trainguard-runs"
    records = [
        json.loads(x) for x in (run_dir / "metrics" / "rank_0.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if r["kind"] == "step"]
    logs = [r for r in records if r["kind"] == "log"]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all(r["tokens"] == 128 and r["samples"] == 4 and r["step_time_s"] >= 0 for r in steps)
    assert [r["loss"] for r in logs] == [1.0, 0.5, 1.0 / 3]


def test_under_torchrun_shares_run_dir_by_run_id(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(SCRIPT)
    r = launch("torchrun", ["--standalone", "--nproc-per-node", "2", "w.py"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    dirs = list((tmp_path / "trainguard-runs").iterdir())
    assert len(dirs) == 1
    assert sorted(p.name for p in (dirs[0] / "metrics").iterdir()) == [
        "rank_0.jsonl",
        "rank_1.jsonl",
    ]


def test_under_agent_progress_is_visible(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(SCRIPT)
    r = launch(
        "trainguard",
        ["--standalone", "--nproc-per-node", "2", "--tg-run-dir", "run", "w.py"],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    reader = ProgressReader(tmp_path / "run" / "progress" / "attempt_0")
    snaps = reader.read_all()
    assert sorted(snaps) == [0, 1]
    for s in snaps.values():
        assert s.step == 2 and s.num_steps == 3 and not s.in_step and s.pid > 0
    assert "True" in r.stdout


def test_progress_writer_heartbeat_and_steps(tmp_path: Path) -> None:
    w = ProgressWriter(progress_path(tmp_path, 3), heartbeat_interval_s=0.05)
    try:
        r = ProgressReader(tmp_path)
        first = r.read(3)
        assert first is not None and first.pid == os.getpid() and first.num_steps == 0
        w.step_begin(7)
        mid = r.read(3)
        assert mid.step == 7 and mid.in_step
        w.step_end(7, 0.25)
        end = r.read(3)
        assert end.step == 7 and not end.in_step and end.last_step_s == 0.25 and end.num_steps == 1
        beat = end.heartbeat
        deadline = time.monotonic() + 5
        while r.read(3).heartbeat == beat:
            assert time.monotonic() < deadline, "heartbeat thread did not refresh"
            time.sleep(0.02)
    finally:
        w.close()
    assert ProgressReader(tmp_path / "missing").read_all() == {}


def test_cli_events_command(tmp_path: Path) -> None:
    from trainguard.core.events import EventLog

    log = EventLog(tmp_path, node="n1", context=lambda: {"attempt": 2, "restart_count": 2})
    log.emit("launch", pid=1)
    out = subprocess.run(
        [sys.executable, "-m", "trainguard", "events", str(tmp_path)],
        capture_output=True,
        text=True,
        env=base_env(),
        cwd=REPO,
    )
    assert out.returncode == 0 and "launch" in out.stdout and "n1" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "trainguard", "events", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env=base_env(),
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
