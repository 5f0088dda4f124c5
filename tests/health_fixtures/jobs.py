"""Run a `trainguard run` job of the health worker with health settings from env."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainguard.runtime.events import read_events

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "health_worker.py"


def job_env(**health: object) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_", "TRAINGUARD_"))
    }
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S"] = "0"
    env["TRAINGUARD_TELEMETRY_ENABLED"] = "false"
    for k, v in health.items():
        env[f"TRAINGUARD_HEALTH_{k.upper()}"] = str(v)
    return env


def run_job(
    run_dir: Path,
    worker_args: list[str],
    *,
    env: dict[str, str],
    max_restarts: int = 0,
    nproc: int = 2,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "trainguard", "run", "--standalone",
        "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
        "--monitor-interval", "0.1", "--tg-run-dir", str(run_dir),
        str(WORKER), *worker_args,
    ]  # fmt: skip
    return subprocess.run(
        cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    return [e for e in read_events(run_dir) if kind is None or e["kind"] == kind]
