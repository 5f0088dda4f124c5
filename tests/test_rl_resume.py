"""examples/rl_fleet.py under ``trainguard run`` in its async mode (``--max-staleness 1``: the
next batch is generated while a step trains) with a real engine and two reward servers:
every prompt is trained on exactly once, in the fault-free order, through kill -9 of a trainer
rank twice (rank 1 by itself as a step begins, rank 0 from outside mid-run), the prefetched
batch's prompts in flight at every checkpoint and handed out again after each restart. A
trainer restart keeps the engine (same PID) and refits it only when its weight version
differs from the restored one. (The on-policy mode through kill -9 of an engine and of each
reward server: tests/test_rl_fleet_job.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fleet_engines import LocalEngines
from tests.launch_utils import REPO, base_env, popen
from trainguard.rl import ConsumedLog, PromptLedger, audit
from trainguard.testing.ports import free_port

RL_FLEET = str(REPO / "examples" / "rl_fleet.py")
STEPS, PROMPTS, BATCH = 10, 16, 4


def events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("kind") == kind:
            out.append(ev)
    return out


def wait_for(cond: Any, what: str, p: subprocess.Popen[str], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if p.poll() is not None:
            raise AssertionError(
                f"the job ended ({p.returncode}) before {what}: {p.stderr.read()[-3000:] if p.stderr else ''}"
            )
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_exactly_once_prompts_through_trainer_kills_async(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # one engine (a torch + transformers import): routing across engines and failover are
    # tests/test_rl_fleet.py's and tests/test_rl_fleet_job.py's; here the trainer's kills
    engines = LocalEngines([free_port()], run_dir=run_dir, args=["--poll-interval-s", "0.3"])
    engines.start()
    rewards = LocalEngines(
        [free_port(), free_port()], run_dir=run_dir, role="reward", module="trainguard.rl.reward",
        args=["--function", "trainguard.rl.tiny:digit_reward"],
    )  # fmt: skip
    rewards.start()
    log = ConsumedLog(run_dir / "rl" / "consumed.jsonl")
    env = base_env(
        TRAINGUARD_ROLLOUT_URLS=",".join(engines.urls),
        TRAINGUARD_REWARD_URLS=",".join(rewards.urls),
        TRAINGUARD_ROLLOUT_TOKEN=engines.token,
        TRAINGUARD_REWARD_TOKEN=rewards.token,
        OMP_NUM_THREADS="1",
    )
    p = popen(
        "trainguard",
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "4", "--tg-run-dir",
         str(run_dir), RL_FLEET, "--steps", str(STEPS), "--prompts", str(PROMPTS), "--batch",
         str(BATCH), "--fail-at-step", "3", "--fail-rank", "1", "--request-timeout", "20",
         "--max-staleness", "1"],
        cwd=tmp_path, env=env,
    )  # fmt: skip
    try:
        pid = engines.pid(0)
        # attempt 0: rank 1 kills itself (SIGKILL) as step 3 begins; attempt 1 resumes at 3
        wait_for(
            lambda: (
                len(events(run_dir, "workers_started")) >= 2
                and max(log.effective(), default=-1) >= 4
            ),
            "step 4 after the restart",
            p,
        )
        started = events(run_dir, "workers_started")[-1]
        rank0 = next(w["pid"] for w in started["workers"] if w["rank"] == 0)
        os.kill(rank0, signal.SIGKILL)  # a second trainer kill, from outside, mid-step
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-4000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        engines.close()
        rewards.close()
    result = audit(log, PROMPTS)
    assert (result.steps, result.skipped, result.duplicated) == (STEPS, 0, 0)
    ledger = PromptLedger(PROMPTS, seed=0)
    assert result.sequence == [
        ledger.prompt_id(g) for g in range(STEPS * BATCH)
    ]  # fault-free order
    # the trainer restarts kept the engine
    assert engines.restarts == [0] and engines.pid(0) == pid
    attached = [e for e in events(run_dir, "rl_trainer_attached") if e["rank"] == 0]
    assert [e["attempt"] for e in attached] == [0, 1, 2]
    for e in attached[1:]:  # a restarted trainer refits the running engine iff it differs
        differ = any(v != e["version"] for v in e["engines_before"].values())
        assert e["refit"] == differ, e
    recs = [json.loads(x) for x in (run_dir / "metrics" / "rank_0.jsonl").read_text().splitlines()]
    logs = [r for r in recs if r.get("kind") == "log" and "reward" in r]
    assert all(0 <= r["staleness_max"] <= 1 for r in logs)  # within the bound
    assert any(r["staleness_max"] == 1 for r in logs)  # prefetched: the previous version's
    assert all(r["rollout_failed"] >= 0 and r["engines_total"] == 1 for r in logs)
    # every trained sample's staleness, recorded per sample by each rank: within the bound,
    # before and after each trainer kill; nothing padded
    trained = events(run_dir, "rollout_samples_trained")
    assert {e["attempt"] for e in trained} == {0, 1, 2} and {e["rank"] for e in trained} == {0, 1}
    per_sample = [s for e in trained for s in e["staleness"]]
    assert per_sample and all(0 <= s <= 1 for s in per_sample), sorted(set(per_sample))
    assert all(g == 4 for e in trained for g in e["group_sizes"])  # whole groups only
