"""TRL's GRPOTrainer under `trainguard run` without a code change (the auto-attached HF
callback): a kill -9 after the first checkpoint redoes at most one step; reward, KL, clip ratio
and completion length reach the run directory under the metric contract's names."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration_jobs import (
    EndpointScraper,
    events,
    logged_keys,
    records,
    restored_steps,
    run_example,
    scraped_env,
)
from trainguard.testing.ports import free_port


@pytest.mark.slow
def test_grpo_kill_resumes_from_the_snapshot_with_rl_metrics(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    port = free_port()
    with EndpointScraper(port) as scraper:
        p = run_example(
            run_dir,
            "trl_grpo.py",
            ["--steps", "8", "--save-steps", "3", "--fail-at-step", "5", "--no-trainguard"],
            env=scraped_env(port),
        )
    assert p.returncode == 0, p.stderr[-3000:]
    # what Prometheus scrapes from the node: loss, throughput, reward and KL
    assert {
        "trainguard_train_loss",
        "trainguard_train_throughput_per_second",
        "trainguard_rl_reward_mean",
        "trainguard_rl_kl",
    } <= scraper.seen, sorted(scraper.seen)
    assert events(run_dir, "integration_auto_attached")
    restored = [s for src, s in restored_steps(run_dir) if s is not None]
    assert restored and 4 <= restored[-1] <= 5  # the framework's checkpoint had step 3
    keys = logged_keys(run_dir, 0)
    assert {"loss", "reward", "reward_std", "kl", "entropy", "clip_ratio"} <= keys
    assert {"response_length", "response_length_max", "rewards/sevens/mean"} <= keys
    assert records(run_dir, 1, "step")  # heartbeats on every rank
    # the agent's export (what Prometheus and OTLP serve) carries them under the contract
    exported = set()
    for path in (run_dir / "telemetry").glob("metrics_*.jsonl"):
        exported |= {json.loads(line)["name"] for line in path.read_text().splitlines() if line}
    assert {
        "trainguard.train.loss",
        "trainguard.train.throughput",
        "trainguard.rl.reward.mean",
        "trainguard.rl.kl",
        "trainguard.rl.clip_fraction",
        "trainguard.rl.response_length.mean",
    } <= exported
    # the HTML report draws them (MFU stays empty: a CPU's peak FLOP/s is unknown)
    report = run_dir / "report.html"
    r = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", str(run_dir), "-o", str(report), "-q"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    charts = re.findall(r'<svg class="tg-chart".*?</svg>', report.read_text(), re.S)
    drawn = {re.search(r"<title>([^<]*)</title>", c).group(1): "no data" not in c for c in charts}
    assert drawn["Loss"] and drawn["Reward"] and drawn["KL to reference"]
    assert drawn["Throughput (tokens/s per device)"]
