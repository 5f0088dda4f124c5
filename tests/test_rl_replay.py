"""Reproducible rollouts: examples/rl_fleet.py on-policy (a ``trainguard run`` job) through a
kill -9 of an engine mid-run and a kill -9 of the trainer ends with weights bitwise equal to
those of the fault-free run with the same seed. Both runs share the same two engines (their
weight store is one directory, the runs' ``rl/weights`` link to it): every sample is drawn
from the stream of (run seed, epoch, prompt id, sample index), whichever engine serves it,
in whatever batch, and a step regenerated after the trainer's restart samples the same
tokens."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.fleet_engines import LocalEngines
from tests.launch_utils import REPO, base_env, popen
from trainguard.rl import ConsumedLog, audit
from trainguard.testing.ports import free_port

RL_FLEET = str(REPO / "examples" / "rl_fleet.py")
STEPS, PROMPTS, BATCH = 6, 8, 4


def _weights(path: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    return dict(load_file(str(path)))


def _job(
    tmp: Path, name: str, shared: Path, engines: LocalEngines, *extra: str
) -> tuple[Path, subprocess.Popen[str]]:
    run = tmp / name
    (run / "rl").mkdir(parents=True)
    (run / "rl" / "weights").symlink_to(shared, target_is_directory=True)
    env = base_env(OMP_NUM_THREADS="1", TRAINGUARD_ROLLOUT_URLS=",".join(engines.urls),
                   TRAINGUARD_ROLLOUT_TOKEN=engines.token,
                   TRAINGUARD_HEALTH_ENABLED="0")  # fmt: skip
    job = popen(
        "trainguard",
        ["--standalone", "--nproc-per-node", "1", "--max-restarts", "2", "--no-tg-warm",
         "--tg-run-dir", str(run), RL_FLEET, "--steps", str(STEPS), "--prompts", str(PROMPTS),
         "--batch", str(BATCH), "--group", "4", "--seed", "5", "--request-timeout", "20",
         *extra],
        cwd=tmp, env=env,
    )  # fmt: skip
    return run, job


@pytest.mark.slow  # two trainer jobs and two engines (torch + transformers each)
def test_run_through_engine_and_trainer_kills_replays_the_fault_free_weights(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "engines" / "rl" / "weights"
    shared.mkdir(parents=True)
    engines = LocalEngines(
        [free_port(), free_port()], run_dir=tmp_path / "engines", args=["--poll-interval-s", "0.3"]
    )
    engines.start()
    try:
        free, job = _job(tmp_path, "fault_free", shared, engines)
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, err[-3000:]
        final = tmp_path / "fault_free.safetensors"
        shutil.copy(shared / f"v{STEPS:08d}.safetensors", final)

        # the same seed through an engine killed -9 after the first step and the trainer
        # killed -9 (by itself) as step 3 begins
        faults, job = _job(tmp_path, "faults", shared, engines,
                           "--fail-at-step", "3", "--fail-rank", "0")  # fmt: skip
        log = ConsumedLog(faults / "rl" / "consumed.jsonl")
        deadline = time.monotonic() + 240
        while max(log.effective(), default=-1) < 0:
            assert job.poll() is None and time.monotonic() < deadline, job.stderr
            time.sleep(0.1)
        engines.kill(0, signal.SIGKILL)
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, err[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        engines.close()
    assert "restart" in (faults / "events.jsonl").read_text()  # the trainer did restart
    result = audit(log, PROMPTS)
    assert (result.steps, result.skipped, result.duplicated) == (STEPS, 0, 0)
    assert audit(ConsumedLog(free / "rl" / "consumed.jsonl"), PROMPTS).sequence == result.sequence

    want, got = _weights(final), _weights(shared / f"v{STEPS:08d}.safetensors")
    assert sorted(want) == sorted(got)
    import torch

    differ = [k for k in want if not torch.equal(want[k], got[k])]  # type: ignore[arg-type]
    assert differ == [], f"{len(differ)} of {len(want)} tensors differ: {differ[:5]}"
