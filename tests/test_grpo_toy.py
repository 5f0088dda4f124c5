"""examples/grpo_toy.py: real GRPO on CPU under trainguard run learns its verifiable task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch_utils import REPO, base_env, launch

GRPO = str(REPO / "examples" / "grpo_toy.py")
STEPS = 50  # the reward of seed 0 is ~0.05 over the first 5 steps, ~0.87 over steps 45-49
RL_KEYS = ("reward", "reward_std", "kl", "entropy", "clip_fraction", "response_length",
           "response_length_max")  # fmt: skip


@pytest.mark.slow
def test_grpo_toy_learns_under_trainguard_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = launch(
        "trainguard",
        ["--standalone", "--nproc-per-node", "2", "--tg-run-dir", str(run_dir), GRPO,
         "--steps", str(STEPS)],
        cwd=tmp_path, env=base_env(), timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in (0, 1):
        recs = [json.loads(line) for line in (run_dir / "metrics" / f"rank_{rank}.jsonl").open()]
        logs = [r for r in recs if r["kind"] == "log" and "reward" in r]
        assert [r["step"] for r in logs] == list(range(STEPS))
        for r in logs:
            for k in RL_KEYS:
                assert isinstance(r[k], float | int), k
            assert 0.0 <= r["clip_fraction"] <= 1.0
            assert r["kl"] >= 0.0
        rewards = [r["reward"] for r in logs]
        k = len(rewards) // 10
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        assert last >= 2 * first, (first, last)
        assert last >= 0.3, (first, last)
        steps = [r for r in recs if r["kind"] == "step"]
        assert all(r["flops"] > 0 for r in steps)  # counted by FlopCounterMode on step 0
        assert all({"rollout", "reward", "optimize"} <= set(r["spans"]) for r in steps)
        names = {r["name"] for r in recs if r["kind"] == "span"}
        assert {"step", "rollout", "reward", "optimize"} <= names
