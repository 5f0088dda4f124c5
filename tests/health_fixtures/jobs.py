"""Run a `trainguard run` job of the health worker with health settings from env."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.launch_utils import base_env
from trainguard.core.events import read_events

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "health_worker.py"


def job_env(**health: object) -> dict[str, str]:
    env = base_env()
    env["TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S"] = "0"
    env["TRAINGUARD_TELEMETRY_ENABLED"] = "false"
    for k, v in health.items():
        env[f"TRAINGUARD_HEALTH_{k.upper()}"] = str(v)
    return env


def job_cmd(
    run_dir: Path, worker_args: list[str], *, max_restarts: int = 0, nproc: int = 2
) -> list[str]:
    return [
        sys.executable, "-m", "trainguard", "run", "--standalone",
        "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
        "--monitor-interval", "0.1", "--tg-run-dir", str(run_dir),
        str(WORKER), *worker_args,
    ]  # fmt: skip


def node_cmd(
    run_dir: Path,
    worker_args: list[str],
    *,
    port: int,
    nnodes: str = "2",
    nproc: int = 1,
    max_restarts: int = 0,
    rdzv_conf: str = "",
) -> list[str]:
    """One node's `trainguard run` of a multi-node job (c10d rendezvous on 127.0.0.1:port)."""
    conf = ["--rdzv-conf", rdzv_conf] if rdzv_conf else []
    return [
        sys.executable, "-m", "trainguard", "run", "--nnodes", nnodes,
        "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
        "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "tg", *conf,
        "--tg-run-dir", str(run_dir), str(WORKER), *worker_args,
    ]  # fmt: skip


def wait_for_event(run_dir: Path, kind: str, *, timeout: float = 60, count: int = 1) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = events(run_dir, kind)
        if len(found) >= count:
            return found
        time.sleep(0.1)
    raise TimeoutError(f"no {kind} event in {run_dir} after {timeout}s")


def run_job(
    run_dir: Path,
    worker_args: list[str],
    *,
    env: dict[str, str],
    max_restarts: int = 0,
    nproc: int = 2,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    cmd = job_cmd(run_dir, worker_args, max_restarts=max_restarts, nproc=nproc)
    return subprocess.run(
        cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    return [e for e in read_events(run_dir) if kind is None or e["kind"] == kind]
