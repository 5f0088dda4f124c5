"""Restarts never hang: a worker kill -9'ed mid-run and restarted, twice in a row in one job
(the soak test: many jobs in a row).

torchrun 2.13 reuses one worker store across attempts, so a restarted worker can read a dead
worker's address and hang in init_process_group; trainguard gives each attempt a fresh store.

The same job is the suite's memory-tier resume of examples/train_mlp.py after a kill -9 under
``trainguard run`` (torch's restart of the whole group): each restart restores both ranks from
the node's memory tier, not from the older disk checkpoints, and the job ends with a fault-free
run's parameters and Adam state, bitwise (test_checkpoint_dist has the restore from disk).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.launch_utils import REPO, base_env, launch
from tests.mlp_reference import assert_same_as_reference

EXAMPLE = str(REPO / "examples" / "train_mlp.py")
SOAK_RUNS = int(os.environ.get("TRAINGUARD_TEST_RESTART_RUNS", "10"))
STEPS = 24
CKPT_EVERY = 8  # disk checkpoints (thread persist mode) at steps 8 and 16, before each kill


@pytest.mark.slow
def test_kill9_restart_twice(tmp_path: Path) -> None:
    """Both ranks killed, each in its own attempt and at a different step (rank 0 at step 13
    of attempt 0, rank 1 at step 21 of attempt 1): every rank, more than one step, and a
    restart after a restart; the soak test below runs the job 10 times."""
    _kill9_restarts(tmp_path, 0)


@pytest.mark.soak
@pytest.mark.timeout(1200)
def test_kill9_restart_many_times(tmp_path: Path) -> None:
    for i in range(SOAK_RUNS):
        _kill9_restarts(tmp_path / f"run{i}", i)


def _kill9_restarts(d: Path, i: int) -> None:
    """One job of 2 ranks killed twice: first rank ``i % 2`` (the example's own ``kill -9``,
    attempt 0), then the other rank (``TRAINGUARD_CHAOS``'s, attempt 1)."""
    d.mkdir(parents=True, exist_ok=True)
    first, second = i % 2, 1 - i % 2
    kill_at = {0: 13 - i % 3, 1: 21 - i % 3}  # attempt -> step
    args = [
        # two restarts are all the job needs: no warm processes are started for a third
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--monitor-interval", "0.1",
        "--tg-run-dir", str(d / "run"),
        EXAMPLE, "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY),
        "--fail-at-step", str(kill_at[0]), "--fail-rank", str(first),
        "--out", str(d / "final.pt"), "--out-optim", str(d / "optim.pt"),
    ]  # fmt: skip
    env = base_env(
        TRAINGUARD_WARM_PRESTART_DELAY_S="0",  # restarts from the zygotes
        TRAINGUARD_CHAOS=f"kill:rank={second},step={kill_at[1]},attempt=1",
    )
    r = launch("trainguard", args, cwd=d, env=env, timeout=180)
    assert r.returncode == 0, f"run {i}: exit {r.returncode}\n{r.stderr[-3000:]}"
    events = [json.loads(x) for x in (d / "run" / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds.count("restart") == 2, kinds
    started = [e for e in events if e["kind"] == "workers_started"]
    assert [e["attempt"] for e in started] == [0, 1, 2], started
    for attempt, rank in ((0, first), (1, second)):
        failed = [
            e
            for e in events
            if e["kind"] == "worker_failed" and e["root_cause"] and e["attempt"] == attempt
        ]
        assert [(e["rank"], e["signal"], e["cause"]) for e in failed] == [
            (rank, "SIGKILL", "killed")
        ], failed
    assert events[-1]["kind"] == "job_finished" and events[-1]["state"] == "succeeded"

    # each restart: both ranks from the memory tier, one step, at most two behind the kill
    restored = [e for e in events if e["kind"] == "checkpoint_restored" and e["step"]]
    assert {e["source"] for e in restored} == {"memory"}, restored
    for attempt in (1, 2):
        got = [e for e in restored if e["attempt"] == attempt]
        assert sorted(e["rank"] for e in got) == [0, 1], restored
        assert len({e["step"] for e in got}) == 1, restored
        assert kill_at[attempt - 1] - 2 <= got[0]["step"] <= kill_at[attempt - 1], restored
    assert_same_as_reference(d / "final.pt", STEPS, optim=d / "optim.pt")  # a fault-free run's
