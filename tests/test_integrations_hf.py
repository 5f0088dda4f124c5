"""transformers' Trainer under `trainguard run`, real processes (2 ranks, gloo): the callback
line and the no-code-change mode; a kill -9 redoes at most one step, the metrics reach the run
directory, a SIGSTOPped rank is named as a hang."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
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
from trainguard.testing.ports import free_port

KILL_AT, SAVE, STEPS = 13, 10, 18


@pytest.fixture(scope="module")
def kill_and_plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two jobs side by side: one with the callback line, kill -9'ed at step 13 and resumed
    (its agent's Prometheus endpoint scraped), and a straight one without the callback line
    and with ``[integrations] auto`` off: plain HF under ``trainguard run``."""
    tmp = tmp_path_factory.mktemp("hf")
    port = free_port()
    args = ["--steps", str(STEPS), "--save-steps", str(SAVE)]
    plain_env = job_env(TRAINGUARD_INTEGRATIONS_AUTO="false")
    with ThreadPoolExecutor(1) as ex:
        straight = ex.submit(
            run_example, tmp / "straight" / "run", "hf_trainer.py",
            [*args, "--no-trainguard", "--out", str(tmp / "a.pt")], env=plain_env,
        )  # fmt: skip
        with EndpointScraper(port) as scraper:
            p = run_example(
                tmp / "run",
                "hf_trainer.py",
                [*args, "--fail-at-step", str(KILL_AT), "--out", str(tmp / "b.pt")],
                env=scraped_env(port),
            )
        s = straight.result()
    return {"tmp": tmp, "killed": p, "plain": s, "seen": scraper.seen}


@pytest.mark.xdist_group("hf_kill")  # one worker runs the shared jobs once
@pytest.mark.slow
def test_kill_after_first_checkpoint_resumes_from_the_snapshot_with_a_straight_runs_weights(
    kill_and_plain: dict[str, Any],
) -> None:
    # dropout off, seeded sampler: HF training here is deterministic on CPU, so the killed and
    # resumed run must end with the weights of a straight one (plain HF, run alongside it)
    import torch

    tmp_path = kill_and_plain["tmp"]
    run_dir = tmp_path / "run"
    p, s = kill_and_plain["killed"], kill_and_plain["plain"]
    assert p.returncode == 0, p.stderr[-3000:]
    assert s.returncode == 0, s.stderr[-3000:]
    # what Prometheus scrapes from the node: the framework's loss and the throughput
    assert {"trainguard_train_loss", "trainguard_train_throughput_per_second"} <= kill_and_plain[
        "seen"
    ]
    assert "trainguard: resumed at step" in p.stderr
    restored = [s for src, s in restored_steps(run_dir) if s is not None]
    assert restored and KILL_AT - 1 <= restored[-1] <= KILL_AT  # <= 1 step redone, not 3
    assert (run_dir / "hf" / f"checkpoint-{SAVE}").is_dir()  # the framework's own one was older
    # metrics on the contract: loss, lr, grad norm (rank 0 only: HF reduces them), heartbeats
    # with tokens and FLOPs on every rank, numbered by the framework's step
    keys = logged_keys(run_dir, 0)
    assert {"loss", "grad_norm", "learning_rate"} <= keys
    assert not records(run_dir, 1, "log") or "loss" not in logged_keys(run_dir, 1)
    for rank in (0, 1):
        steps = records(run_dir, rank, "step")
        assert steps and all(r["tokens"] > 0 and r["flops"] > 0 for r in steps)
    last = records(run_dir, 0, "step")[-1]
    assert last["step"] == STEPS - 1 and last["attempt"] == 1
    assert events(run_dir, "integration_attached")
    # nothing lost: the resumed run's final weights are the straight run's, bit for bit
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def stopped_then_preempted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """hf_trainer.py without its trainguard line (auto-attached), rank 1 SIGSTOPped inside
    step 6 of attempt 0, then, in the restarted attempt 1, a preemption notice (SIGUSR1) to
    rank 0 at step 8: its run directory and the finished process."""
    run_dir = tmp_path_factory.mktemp("hf_stopped") / "run"
    env = job_env(
        TRAINGUARD_CHAOS="hang:rank=1,step=6;kill:rank=0,step=8,signal=USR1,attempt=1",
        TRAINGUARD_HEALTH_HANG_TIMEOUT_S=str(HANG_TIMEOUT_S),
    )
    p = run_example(
        run_dir, "hf_trainer.py", ["--steps", "10", "--save-steps", "100", "--no-trainguard"],
        env=env,
    )  # fmt: skip
    return {"run_dir": run_dir, "p": p}


@pytest.mark.xdist_group("hf_stopped")  # one worker runs the shared job once
@pytest.mark.slow
def test_no_code_change_attaches_and_a_stopped_rank_is_a_hang(
    stopped_then_preempted: dict[str, Any],
) -> None:
    run_dir, p = stopped_then_preempted["run_dir"], stopped_then_preempted["p"]
    # the job ends on the preemption of its restarted attempt (75): see the test below
    assert_stopped_rank_named(run_dir, p, "transformers", HANG_TIMEOUT_S, returncode=75)
    assert len(events(run_dir, "hang_detected")) == 1  # training's end is not a hang
    # the restarted job resumed from the snapshot of the hung step, not from scratch
    restored = [s for src, s in restored_steps(run_dir) if s is not None]
    assert restored and restored[-1] >= 5


@pytest.mark.xdist_group("hf_kill")  # one worker runs the shared jobs once
@pytest.mark.slow
def test_auto_off_leaves_the_job_alone(kill_and_plain: dict[str, Any]) -> None:
    # the straight run of the kill test: no callback line, auto off
    run_dir = kill_and_plain["tmp"] / "straight" / "run"
    p = kill_and_plain["plain"]
    assert p.returncode == 0, p.stderr[-3000:]
    assert "attached to" not in p.stderr
    assert not events(run_dir, "integration_auto_attached")
    assert not records(run_dir, 0, "step")


@pytest.mark.xdist_group("hf_stopped")  # one worker runs the shared job once
@pytest.mark.slow
def test_preemption_saves_the_framework_checkpoint_and_exits_75(
    stopped_then_preempted: dict[str, Any],
) -> None:
    # the preemption notice of the stopped-rank job's restarted attempt
    run_dir, p = stopped_then_preempted["run_dir"], stopped_then_preempted["p"]
    assert p.returncode == 75, p.stderr[-3000:]
    [pre] = events(run_dir, "integration_preempted")
    assert pre["step"] >= 8
    assert (run_dir / "hf" / f"checkpoint-{pre['step']}").is_dir()  # HF's own, at that step
    assert "exiting with 75" in p.stderr
