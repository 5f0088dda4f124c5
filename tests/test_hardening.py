"""Input and environment hardening: [slurm] values with a trailing newline, [ft] values, temp
files in a run directory that agents with equal pids share, and injected faults that never arm
silently nor follow a job into its requeue or resubmission (real ``trainguard run`` and
``trainguard slurm agent`` processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.launch_utils import REPO, base_env, steps_done
from tests.test_slurm_batch import FakeSlurm, _finish
from trainguard.core.config import ConfigError, load_config, write_effective
from trainguard.core.config.ft import FTConfig
from trainguard.core.config.rollback import RollbackConfig
from trainguard.core.config.slurm import SlurmConfig
from trainguard.core.events import EventLog
from trainguard.recovery.rollback import RollbackLedger
from trainguard.slurm.batch import valid_time

EXAMPLE = str(REPO / "examples" / "train_mlp.py")


# -- [slurm]: a trailing newline must not pass --------------------------------------------------
@pytest.mark.parametrize(
    "kw", [{"signal": "USR1\n"}, {"blocklist": ["gpu-17\n"]}, {"signal": "SIGUSR1\n"}]
)
def test_slurm_values_with_a_trailing_newline_are_refused(kw: dict) -> None:
    with pytest.raises(ValueError):
        SlurmConfig(**kw)
    assert SlurmConfig(signal="USR1", blocklist=["gpu-[1-3],gpu-9"]).signal == "USR1"


def test_slurm_time_with_a_trailing_newline_is_refused() -> None:
    assert valid_time("1:00:00") and not valid_time("1:00:00\n")


# -- [ft] -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "key, value, what",
    [
        ("MIN_REPLICAS", "0", "min_replicas"),
        ("LIGHTHOUSE_PORT", "70000", "lighthouse_port"),
        ("HEARTBEAT_TIMEOUT_MS", "0", "heartbeat_timeout_ms"),
        ("QUORUM_TICK_MS", "-5", "quorum_tick_ms"),
        ("JOIN_TIMEOUT_MS", "-1", "join_timeout_ms"),
        ("TIMEOUT_S", "0", "timeout_s"),
        ("QUORUM_TIMEOUT_S", "-1", "quorum_timeout_s"),
        ("REPLICA_GROUP", "-2", "replica_group"),
    ],
)
def test_ft_config_is_validated(key: str, value: str, what: str) -> None:
    with pytest.raises(ConfigError, match=rf"\[ft\]: {what} = ") as info:
        load_config(env={f"TRAINGUARD_FT_{key}": value})
    assert "\n" not in str(info.value)
    FTConfig(min_replicas=2, replica_group=0, join_timeout_ms=0)  # valid ones pass


# -- temp files in the shared run directory ------------------------------------------------------
def _hammer(write: object, monkeypatch: pytest.MonkeyPatch, n: int = 300) -> list[BaseException]:
    """Two writers with the same pid (agents in two containers) write the same file at once."""
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    errors: list[BaseException] = []

    def run(tag: int) -> None:
        for i in range(n):
            try:
                write(tag, i)  # type: ignore[operator]
            except BaseException as e:  # reported below
                errors.append(e)
                return

    threads = [threading.Thread(target=run, args=(t,)) for t in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def test_config_json_writers_with_equal_pids_never_clash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    errors = _hammer(
        lambda tag, i: write_effective(tmp_path, {"writer": tag, "i": i, "pad": "x" * 20000}),
        monkeypatch,
    )
    assert not errors, errors[:1]
    doc = json.loads((tmp_path / "config.json").read_text())  # whole: one writer's last
    assert doc["i"] == 299 and len(doc["pad"]) == 20000
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temp file left


def test_rollback_ledger_writers_with_equal_pids_never_clash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def save(tag: int, i: int) -> None:
        ledger = RollbackLedger(RollbackConfig())
        ledger.windows = [(tag * 1000 + j, tag * 1000 + j) for j in range(0, 400, 2)]
        ledger.save(tmp_path)

    assert not _hammer(save, monkeypatch)
    ledger = RollbackLedger.load(tmp_path, RollbackConfig())
    assert len(ledger.windows) == 200
    assert [p.name for p in tmp_path.iterdir()] == ["rollback.json"]


def test_the_webhook_token_is_not_written_to_config_json(tmp_path: Path) -> None:
    url = "https://hooks.example.com/services/T0/B0/S3CRET-PATH?token=S3CRET-Q"
    cfg = load_config(env={"TRAINGUARD_ALERTS_WEBHOOK_URL": url})
    write_effective(tmp_path, {"trainguard": cfg.to_dict()})
    text = (tmp_path / "config.json").read_text()
    assert "S3CRET" not in text
    assert (
        json.loads(text)["trainguard"]["alerts"]["webhook_url"] == "https://hooks.example.com/..."
    )
    assert cfg.alerts.webhook_url == url  # the agent itself still has it


# -- TRAINGUARD_CHAOS --------------------------------------------------------------------------------
def _events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def test_injected_faults_arm_with_a_line_and_an_event(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "1",
         "--tg-run-dir", str(run_dir), EXAMPLE, "--steps", "4"],
        cwd=tmp_path, env=base_env(TRAINGUARD_CHAOS="slow:rank=0,delay=0.01"),
        capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    armed = [e for e in _events(run_dir) if e["kind"] == "chaos_armed"]
    agent = [e for e in armed if "rank" not in e]
    worker = [e for e in armed if e.get("rank") == 0]
    assert len(agent) == 1 and agent[0]["spec"] == "slow:rank=0,delay=0.01", armed
    assert len(worker) == 1 and "rank 0: steps +0.01 s" in worker[0]["faults"][0], armed
    assert "TRAINGUARD_CHAOS is set: faults will be injected" in p.stderr
    assert "injected faults armed" in p.stderr


def test_a_requeued_job_runs_without_the_injected_faults(tmp_path: Path) -> None:
    """``trainguard slurm agent`` in a requeued job (SLURM_RESTART_COUNT=1): Slurm keeps the
    job's environment, the attempt counter starts at 0 again, and ``kill at step 1`` would
    fire again in every requeue; it is dropped with one line."""
    run_dir = tmp_path / "run"
    env = base_env(
        TRAINGUARD_CHAOS="kill:rank=0,step=1", SLURM_JOB_ID="88", SLURMD_NODENAME="n1",
        SLURM_RESTART_COUNT="1",
    )  # fmt: skip
    p = subprocess.run(
        [sys.executable, "-m", "trainguard", "slurm", "agent", "--standalone",
         "--nproc-per-node", "1", "--tg-run-dir", str(run_dir), EXAMPLE, "--steps", "4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert steps_done(run_dir) == 3
    assert "TRAINGUARD_CHAOS ignored: job 88 is a requeue (restart 1)" in p.stderr
    assert not [e for e in _events(run_dir) if e["kind"] == "chaos_armed"]


def test_a_resubmitted_job_does_not_inherit_the_injected_faults(tmp_path: Path) -> None:
    for n in ("n1", "n3"):
        EventLog(tmp_path, node=n).emit("job_finished", state="failed")
    slurm = FakeSlurm()
    assert _finish(tmp_path, slurm, 1, {"TRAINGUARD_CHAOS": "kill:rank=1,step=5"}) == 1
    ((_, extra, env),) = slurm.submitted
    assert any(x.startswith("--export=ALL,") for x in extra)  # the environment it submits from
    assert env is not None and "TRAINGUARD_CHAOS" not in env and env["SLURM_CONF"]
