"""Lightning under `trainguard run`, real processes (2 ranks, gloo): a kill -9 after the first
ModelCheckpoint redoes at most one step with the callback, metrics per rank reach the run
directory, a preemption notice saves Lightning's last checkpoint and exits 75."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration_jobs import (
    EndpointScraper,
    events,
    job_env,
    logged_keys,
    records,
    restored_steps,
    run_example,
    run_stopped_rank_job,
    scraped_env,
)
from tests.ports import free_port


@pytest.mark.slow
def test_kill_after_first_checkpoint_resumes_from_the_snapshot(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    port = free_port()
    with EndpointScraper(port) as scraper:
        p = run_example(
            run_dir,
            "lightning_trainer.py",
            ["--steps", "30", "--save-steps", "10", "--fail-at-step", "17"],
            env=scraped_env(port),
        )
    assert p.returncode == 0, p.stderr[-3000:]
    # what Prometheus scrapes from the node: the framework's loss and the throughput (samples
    # per second: the example's model reads no tokens)
    assert {"trainguard_train_loss", "trainguard_train_sample_throughput_per_second"} <= (
        scraper.seen
    ), sorted(scraper.seen)
    restored = [s for src, s in restored_steps(run_dir) if s is not None]
    assert restored and 16 <= restored[-1] <= 17  # Lightning's own checkpoint had step 10
    for rank in (0, 1):  # each rank logs its own values (Lightning does not reduce them)
        assert {"loss", "lr"} <= logged_keys(run_dir, rank)
        assert records(run_dir, rank, "step")[-1]["step"] == 29
        assert all(r["samples"] == 16 for r in records(run_dir, rank, "step"))


@pytest.mark.slow
def test_preemption_saves_last_checkpoint_and_exits_75(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = job_env(TRAINGUARD_CHAOS="kill:rank=1,step=6,signal=USR1")
    p = run_example(
        run_dir, "lightning_trainer.py", ["--steps", "40", "--save-steps", "100"], env=env
    )
    assert p.returncode == 75, p.stderr[-3000:]
    [pre] = events(run_dir, "integration_preempted")
    assert pre["step"] >= 6
    assert (run_dir / "lightning" / "last.ckpt").is_file()


@pytest.mark.slow
def test_no_code_change_attaches_and_a_stopped_rank_is_a_hang(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_stopped_rank_job(run_dir, "lightning_trainer.py", 12, "lightning")
