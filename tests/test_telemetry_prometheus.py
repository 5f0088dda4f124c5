"""A real Prometheus scrapes the node agent's /metrics during a 2-process GRPO run."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch_utils import REPO, base_env, popen
from tests.services.telemetry_services import Prometheus, free_port, wait_until

pytestmark = pytest.mark.prometheus

GRPO = str(REPO / "examples" / "grpo_toy.py")


@pytest.mark.slow
def test_prometheus_scrapes_agent_endpoint_during_run(tmp_path: Path) -> None:
    port = free_port()
    prom = Prometheus(tmp_path / "prom", [f"127.0.0.1:{port}"])
    run_dir = tmp_path / "run"
    env = base_env(
        TRAINGUARD_TELEMETRY_PROMETHEUS_PORT=str(port),
        TRAINGUARD_TELEMETRY_PEAK_FLOPS="1e10",
        TRAINGUARD_TELEMETRY_POLL_INTERVAL_S="0.2",
    )
    proc = popen(
        "trainguard",
        ["--standalone", "--nproc-per-node", "2", "--tg-run-dir", str(run_dir), GRPO,
         "--steps", "1000", "--step-sleep", "0.05"],
        cwd=tmp_path, env=env,
    )  # fmt: skip
    series = {
        "throughput": "trainguard_train_throughput_per_second",
        "mfu": "trainguard_train_mfu_ratio",
        "reward": "trainguard_rl_reward_mean",
        "kl": "trainguard_rl_kl",
        "job_throughput": "trainguard_job_throughput_per_second",
    }
    try:

        def all_present() -> dict[str, list]:
            got = {k: prom.query(q) for k, q in series.items()}
            ranks = {k: {r["metric"].get("rank") for r in v} for k, v in got.items()}
            per_rank = ("throughput", "mfu", "reward", "kl")
            if all(ranks[k] >= {"0", "1"} for k in per_rank) and got["job_throughput"]:
                return got
            return {}

        got = wait_until(all_present, 120, "throughput, MFU, reward and KL series in Prometheus", 1)
        assert proc.poll() is None, "the run ended before Prometheus saw every series"
        for r in got["mfu"]:
            assert 0 < float(r["value"][1]) < 1e6
        for r in got["throughput"]:
            assert float(r["value"][1]) > 0
            assert r["metric"]["job"] == "trainguard"
        # the port in use is published in the run dir
        files = list(run_dir.glob("prometheus_*.json"))
        assert len(files) == 1
        assert json.loads(files[0].read_text())["port"] == port
        # range query: reward is a time series, not a single sample
        time.sleep(2)
        assert prom.query("count_over_time(trainguard_rl_reward_mean[1m]) > 1")
        assert proc.poll() is None, "the run must still be going"
    finally:
        # seen everything: stop the job like a user would (Ctrl-C), keeping the test short
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=30)
        prom.stop()
