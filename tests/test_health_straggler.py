"""Straggler scores: the scorer's logic, and real 2-process jobs (one slow rank, a clean run)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.health_fixtures.jobs import events, job_env, run_job
from trainguard.health.config import HealthConfig
from trainguard.health.straggler import StragglerScorer

CFG = dict(straggler_min_delta_s=0.005)


def feed(scorer: StragglerScorer, steps: range, times: dict[int, float]) -> list[dict]:
    found = []
    for s in steps:
        for r, t in times.items():
            scorer.add(r, s, t)
        found += scorer.evaluate()
    return found


def test_scores_against_the_others_median() -> None:
    sc = StragglerScorer(HealthConfig(**CFG), [0, 1, 2, 3])
    found = feed(sc, range(40), {0: 0.1, 1: 0.1, 2: 0.15, 3: 0.1})
    assert [f["rank"] for f in found] == [2]
    assert abs(found[0]["score"] - (1 - 0.1 / 0.15)) < 1e-3
    assert found[0]["step"] <= 30
    assert sc.scores[0] == 0.0 and abs(sc.scores[2] - 0.3333) < 1e-3


def test_warmup_and_blips_are_not_stragglers() -> None:
    sc = StragglerScorer(HealthConfig(**CFG), [0, 1])
    # rank 1 compiles slowly for the first 3 steps, then a one-step hiccup at step 20.
    for s in range(100):
        sc.add(0, s, 0.1)
        sc.add(1, s, 5.0 if s < 3 or s == 20 else 0.1)
        assert sc.evaluate() == []


def test_noise_below_min_delta_is_ignored() -> None:
    sc = StragglerScorer(HealthConfig(straggler_min_delta_s=0.05), [0, 1])
    assert feed(sc, range(60), {0: 0.004, 1: 0.008}) == []  # 2x, but 4 ms
    low = HealthConfig(straggler_min_delta_s=0.001)
    assert feed(StragglerScorer(low, [0, 1]), range(60), {0: 0.004, 1: 0.008})


def test_single_rank_has_no_straggler() -> None:
    sc = StragglerScorer(HealthConfig(**CFG), [0])
    assert feed(sc, range(50), {0: 1.0}) == []


def test_slow_rank_is_reported_within_30_steps(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    p = run_job(
        run_dir,
        [
            "--steps",
            "40",
            "--compute-s",
            "0.04",
            "--sleep",
            "--slow-rank",
            "1",
            "--slow-factor",
            "1.5",
        ],
        env=job_env(straggler_min_delta_s=0.005),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    found = events(run_dir, "straggler_detected")
    assert [e["rank"] for e in found] == [1], found
    assert found[0]["step"] < 30
    assert 0.2 <= found[0]["score"] <= 0.45
    scores = json.loads(next((run_dir / "health").glob("straggler_scores.*.json")).read_text())
    assert scores["stragglers"] == [1] and scores["scores"]["1"] > scores["scores"]["0"]


def test_clean_200_step_run_reports_none(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    p = run_job(
        run_dir,
        ["--steps", "200", "--compute-s", "0.02", "--sleep"],
        env=job_env(straggler_min_delta_s=0.005),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert events(run_dir, "straggler_detected") == []
    scores = json.loads(next((run_dir / "health").glob("straggler_scores.*.json")).read_text())
    assert scores["stragglers"] == [] and set(scores["scores"]) == {"0", "1"}
