"""Lightning under `trainguard run`, real processes (2 ranks, gloo): a kill -9 after the first
ModelCheckpoint redoes at most one step with the callback, metrics per rank reach the run
directory, a preemption notice saves Lightning's last checkpoint and exits 75. The kill job
goes on to a stopped rank (SIGSTOP, attempt 1), named as a hang, and to
test_framework_breakage.py's renamed loop counter: its attempt 2's restore meets the rename:
the job finishes with resume off, from Lightning's own checkpoint (nothing of trainguard's
snapshot half-applied). The preemption job runs the example without its trainguard line
(auto-attached)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration_jobs import (
    HANG_TIMEOUT_S,
    EndpointScraper,
    events,
    job_env,
    logged_keys,
    records,
    run_example,
    scraped_env,
)
from tests.test_framework_breakage import assert_degraded, renamed_env
from trainguard.testing.ports import free_port

KILL_AT, RENAMED_AT = 17, 2  # attempt 0's kill -9 (the example's); the attempt renamed in


@pytest.fixture(scope="module")
def killed_then_renamed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """lightning_trainer.py with the callback line, 30 steps, a ModelCheckpoint every 10: rank
    1 kill -9'ed at step 17 (attempt 0) and SIGSTOPped inside step 24 (attempt 1, chaos
    ``hang``: a hang), the loop counter ``_batches_that_stepped`` renamed for trainguard in
    attempt 2 (test_framework_breakage's rename); its agent's Prometheus endpoint scraped. Its
    run directory, the finished process and the metric names scraped."""
    tmp = tmp_path_factory.mktemp("pl_kill")
    run_dir = tmp / "run"
    port = free_port()
    env = scraped_env(
        port,
        TRAINGUARD_CHAOS="hang:rank=1,step=24,attempt=1",
        TRAINGUARD_HEALTH_HANG_TIMEOUT_S=str(HANG_TIMEOUT_S),
        RENAME_FROM_ATTEMPT=str(RENAMED_AT),
    )
    with EndpointScraper(port) as scraper:
        p = run_example(
            run_dir,
            "lightning_trainer.py",
            ["--steps", "30", "--save-steps", "10", "--fail-at-step", str(KILL_AT)],
            env=renamed_env(tmp, "lightning", env),
            max_restarts=3,  # one to spare, as with one fault and 2
        )
    return {"run_dir": run_dir, "p": p, "seen": scraper.seen}


@pytest.mark.xdist_group("lightning_kill")  # one worker runs the shared job once
@pytest.mark.slow
def test_kill_after_first_checkpoint_resumes_from_the_snapshot(
    killed_then_renamed: dict[str, Any],
) -> None:
    run_dir, p = killed_then_renamed["run_dir"], killed_then_renamed["p"]
    assert p.returncode == 0, p.stderr[-3000:]
    # what Prometheus scrapes from the node: the framework's loss and the throughput (samples
    # per second: the example's model reads no tokens)
    seen = killed_then_renamed["seen"]
    assert {"trainguard_train_loss", "trainguard_train_sample_throughput_per_second"} <= seen, (
        sorted(seen)
    )
    # attempt 1 (after the kill at step 17) resumed from trainguard's snapshot
    restored = [
        e["step"]
        for e in events(run_dir, "checkpoint_restored")
        if e.get("attempt") == 1 and e.get("step") is not None
    ]
    assert restored and 16 <= restored[-1] <= 17  # Lightning's own checkpoint had step 10
    [attached] = [a for a in events(run_dir, "integration_attached") if a["attempt"] == 1]
    assert attached["resume"] is True and 16 <= attached["resumed_step"] <= 17
    # and trained on from there (until rank 1 was stopped, at step 24)
    assert max(r["step"] for r in records(run_dir, 0, "step") if r["attempt"] == 1) >= 20
    for rank in (0, 1):  # each rank logs its own values (Lightning does not reduce them)
        assert {"loss", "lr"} <= logged_keys(run_dir, rank)
        assert records(run_dir, rank, "step")[-1]["step"] == 29
        assert all(r["samples"] == 16 for r in records(run_dir, rank, "step"))


@pytest.mark.xdist_group("lightning_kill")  # one worker runs the shared job once
@pytest.mark.slow
def test_lightning_renamed_loop_counter_finishes_the_job_with_resume_off(
    killed_then_renamed: dict[str, Any],
) -> None:
    # test_framework_breakage's case: a Lightning release without the loop counter
    run_dir, p = killed_then_renamed["run_dir"], killed_then_renamed["p"]
    assert p.returncode == 0, p.stderr[-3000:]
    # attempt 2's restore looks up the loop counters first: the renamed one fails there
    assert_degraded(run_dir, p.stderr, "lightning", "restoring trainguard's snapshot")
    attached = events(run_dir, "integration_attached")
    assert [a["attempt"] for a in attached] == [0, 1, RENAMED_AT]
    assert [a["resume"] for a in attached] == [True, True, False]
    # nothing of the snapshot (step 24) was applied: the loop's internals are found before the
    # restore, so attempt 2 trains on from Lightning's own last.ckpt (step 20), consistently
    assert not [e for e in events(run_dir, "checkpoint_restored") if e["attempt"] == RENAMED_AT]
    for rank in (0, 1):
        steps = [r["step"] for r in records(run_dir, rank, "step") if r["attempt"] == RENAMED_AT]
        assert steps == list(range(20, 30)), steps
    assert events(run_dir, "job_finished")[-1]["state"] == "succeeded"


@pytest.mark.xdist_group("lightning_kill")  # one worker runs the shared job once
@pytest.mark.slow
def test_a_stopped_rank_is_a_hang(killed_then_renamed: dict[str, Any]) -> None:
    # the kill job's attempt 1: rank 1 SIGSTOPped right at the begin of step 24 (after its
    # heartbeat), named within the hang timeout + 2 s; the job restarted (attempt 2) and finished
    run_dir, p = killed_then_renamed["run_dir"], killed_then_renamed["p"]
    assert p.returncode == 0, p.stderr[-3000:]
    [hang, *_] = events(run_dir, "hang_detected")
    assert hang["ranks"] == [1] and hang["hang_kind"] == "frozen"
    assert hang["attempt"] == 1
    assert hang["per_rank"]["1"]["no_progress_s"] <= HANG_TIMEOUT_S + 2


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """lightning_trainer.py without its trainguard line (auto-attached), a preemption notice
    (SIGUSR1) to rank 1 at step 9: its run directory and the finished process."""
    run_dir = tmp_path_factory.mktemp("pl_preempted") / "run"
    env = job_env(TRAINGUARD_CHAOS="kill:rank=1,step=9,signal=USR1")
    p = run_example(
        run_dir, "lightning_trainer.py", ["--steps", "12", "--save-steps", "100", "--no-trainguard"],
        env=env,
    )  # fmt: skip
    return {"run_dir": run_dir, "p": p}


@pytest.mark.xdist_group("lightning_preempted")  # one worker runs the shared job once
@pytest.mark.slow
def test_preemption_saves_last_checkpoint_and_exits_75(preempted: dict[str, Any]) -> None:
    run_dir, p = preempted["run_dir"], preempted["p"]
    assert p.returncode == 75, p.stderr[-3000:]
    [pre] = events(run_dir, "integration_preempted")
    assert pre["step"] >= 9
    assert (run_dir / "lightning" / "last.ckpt").is_file()


@pytest.mark.xdist_group("lightning_preempted")  # one worker runs the shared job once
@pytest.mark.slow
def test_no_code_change_attaches(preempted: dict[str, Any]) -> None:
    # the preemption job: the example without its trainguard line, auto-attached (the stopped
    # rank named as a hang: test_a_stopped_rank_is_a_hang, in the kill job)
    run_dir, p = preempted["run_dir"], preempted["p"]
    assert p.returncode == 75, p.stderr[-3000:]
    assert "trainguard: attached to the lightning Trainer" in p.stderr
    assert events(run_dir, "integration_auto_attached")
    assert "loss" in logged_keys(run_dir, 0)
