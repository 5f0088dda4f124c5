"""Lightning under `trainguard run`, real processes (2 ranks, gloo): a kill -9 after the first
ModelCheckpoint redoes at most one step with the callback, metrics per rank reach the run
directory, a preemption notice saves Lightning's last checkpoint and exits 75."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration_jobs import (
    HANG_TIMEOUT_S,
    EndpointScraper,
    assert_stopped_rank_named,
    events,
    job_env,
    logged_keys,
    records,
    restored_steps,
    run_example,
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


@pytest.fixture(scope="module")
def stopped_then_preempted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """lightning_trainer.py without its trainguard line (auto-attached), rank 1 SIGSTOPped
    inside step 6 of attempt 0, then, in the restarted attempt 1, a preemption notice
    (SIGUSR1) to rank 1 at step 9: its run directory and the finished process."""
    run_dir = tmp_path_factory.mktemp("pl_stopped") / "run"
    env = job_env(
        TRAINGUARD_CHAOS="hang:rank=1,step=6;kill:rank=1,step=9,signal=USR1,attempt=1",
        TRAINGUARD_HEALTH_HANG_TIMEOUT_S=str(HANG_TIMEOUT_S),
    )
    p = run_example(
        run_dir, "lightning_trainer.py", ["--steps", "12", "--save-steps", "100", "--no-trainguard"],
        env=env,
    )  # fmt: skip
    return {"run_dir": run_dir, "p": p}


@pytest.mark.xdist_group("lightning_stopped")  # one worker runs the shared job once
@pytest.mark.slow
def test_preemption_saves_last_checkpoint_and_exits_75(
    stopped_then_preempted: dict[str, Any],
) -> None:
    # the preemption notice of the stopped-rank job's restarted attempt
    run_dir, p = stopped_then_preempted["run_dir"], stopped_then_preempted["p"]
    assert p.returncode == 75, p.stderr[-3000:]
    [pre] = events(run_dir, "integration_preempted")
    assert pre["step"] >= 9
    assert (run_dir / "lightning" / "last.ckpt").is_file()


@pytest.mark.xdist_group("lightning_stopped")  # one worker runs the shared job once
@pytest.mark.slow
def test_no_code_change_attaches_and_a_stopped_rank_is_a_hang(
    stopped_then_preempted: dict[str, Any],
) -> None:
    run_dir, p = stopped_then_preempted["run_dir"], stopped_then_preempted["p"]
    # the job ends on the preemption of its restarted attempt (75): see the test above
    assert_stopped_rank_named(run_dir, p, "lightning", HANG_TIMEOUT_S, returncode=75)
