"""A restart never waits for the shutdown timeout.

Rank 1 exits 1 while rank 0 is inside a 120 s step of a script that uses trainguard's
checkpoints (so its preemption handlers are installed). torch's agent tears the group down
with SIGTERM and escalates to SIGKILL after ``--shutdown-timeout`` (60 s here): before the fix
rank 0 took the SIGTERM for a preemption notice and kept stepping until the SIGKILL. Now the
agent marks the teardown first and rank 0 stops on the SIGTERM itself."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.launch_utils import REPO, base_env, popen
from tests.procs import kill_tree

WORKER = str(REPO / "bench" / "teardown_worker.py")
SHUTDOWN_TIMEOUT_S = 60


@pytest.mark.slow
def test_restart_does_not_wait_for_the_shutdown_timeout(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_dir = tmp_path / "run"
    args = [
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--tg-run-dir", str(run_dir),
        WORKER, "--out", str(out),
    ]  # fmt: skip
    p = popen("trainguard", args, cwd=tmp_path, env=base_env())
    try:
        _, err = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        err = ""
    finally:
        kill_tree(p)
    assert p.returncode == 0, err[-3000:]
    failed = float((out / "failed_at").read_text())
    started = min(float(f.read_text()) for f in out.glob("started_1_*"))
    # well under the shutdown timeout: the survivor did not hold the restart until SIGKILL
    assert started - failed < SHUTDOWN_TIMEOUT_S / 2, started - failed
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    first = [e for e in events if e["kind"] == "worker_failed" and e["attempt"] == 0]
    by_rank = {e["rank"]: e for e in first}
    assert by_rank[1]["exitcode"] == 1
    if 0 in by_rank:  # the survivor ended on the teardown's SIGTERM, never on the SIGKILL
        assert by_rank[0].get("signal") != "SIGKILL", by_rank[0]
