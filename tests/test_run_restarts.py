"""Restarts never hang: a worker kill -9'ed mid-run and restarted, many times in a row.

torchrun 2.13 reuses one worker store across attempts, so a restarted worker can read a dead
worker's address and hang in init_process_group; trainguard gives each attempt a fresh store.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.launch_utils import REPO, base_env, launch

EXAMPLE = str(REPO / "examples" / "train_mlp.py")
SOAK_RUNS = int(os.environ.get("TRAINGUARD_TEST_RESTART_RUNS", "20"))


@pytest.mark.slow
def test_kill9_restart_twice(tmp_path: Path) -> None:
    """Both ranks killed, each at a different step (rank 0 at step 3, rank 1 at step 4): two
    runs show what three did (every rank, more than one step); the soak test below runs 20."""
    _kill9_restarts(tmp_path, 2)


@pytest.mark.soak
@pytest.mark.timeout(1200)
def test_kill9_restart_twenty_times(tmp_path: Path) -> None:
    _kill9_restarts(tmp_path, SOAK_RUNS)


def _kill9_restarts(tmp_path: Path, runs: int) -> None:
    finals = []
    for i in range(runs):
        d = tmp_path / f"run{i}"
        d.mkdir()
        args = [
            # one restart is all the job needs (the kill comes on the first attempt only): no warm
            # processes are started for a restart that cannot come
            "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1",
            "--tg-run-dir", str(d / "run"),
            EXAMPLE, "--steps", "12", "--fail-at-step", str(3 + i % 6), "--fail-rank", str(i % 2),
            "--out", str(d / "final.pt"),
        ]  # fmt: skip
        warm = base_env(TRAINGUARD_WARM_PRESTART_DELAY_S="0")  # restarts from the zygotes
        r = launch("trainguard", args, cwd=d, env=warm, timeout=120)
        assert r.returncode == 0, f"run {i}: exit {r.returncode}\n{r.stderr[-3000:]}"
        events = [json.loads(x) for x in (d / "run" / "events.jsonl").read_text().splitlines()]
        kinds = [e["kind"] for e in events]
        assert kinds.count("worker_failed") >= 1, kinds
        failed = next(e for e in events if e["kind"] == "worker_failed" and e["root_cause"])
        assert failed["rank"] == i % 2
        assert failed["signal"] == "SIGKILL" and failed["cause"] == "killed"
        assert events[-1]["kind"] == "job_finished" and events[-1]["state"] == "succeeded"
        finals.append(torch.load(d / "final.pt", weights_only=True))
    # Without checkpoints the restarted job trains from scratch: every run ends identical.
    for f in finals[1:]:
        for k in f:
            assert torch.equal(f[k], finals[0][k])
