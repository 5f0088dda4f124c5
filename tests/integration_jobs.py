"""Run the framework examples (examples/hf_trainer.py, trl_grpo.py, lightning_trainer.py)
under `trainguard run` for the integration tests."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

from tests.launch_utils import base_env
from trainguard.core.events import read_events

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def job_env(**extra: str) -> dict[str, str]:
    env = base_env(**extra)
    env["TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S"] = "0"
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def run_example(
    run_dir: Path,
    script: str,
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    max_restarts: int = 2,
    timeout: float = 420,
    nproc: int = 2,
) -> subprocess.CompletedProcess[str]:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", str(nproc),
        "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
        "--tg-run-dir", str(run_dir), str(EXAMPLES / script), *args,
    ]  # fmt: skip
    return subprocess.run(
        cmd,
        cwd=run_dir.parent,
        env=env if env is not None else job_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


class EndpointScraper:
    """Scrapes the node agent's Prometheus endpoint (``[telemetry] prometheus_port``) every
    ``interval_s`` while a job runs, as Prometheus would: :attr:`seen` holds every metric name
    that carried a number (not NaN) at least once."""

    def __init__(self, port: int, interval_s: float = 0.5) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.interval_s = interval_s
        self.seen: set[str] = set()
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EndpointScraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:
                    text = r.read().decode()
            except OSError:  # not up yet, or between attempts
                continue
            self.scrapes += 1
            for line in text.splitlines():
                if not line or line.startswith("#"):
                    continue
                name, _, value = line.rpartition(" ")
                if value.lower() != "nan":
                    self.seen.add(name.split("{", 1)[0])


def scraped_env(port: int, **extra: str) -> dict[str, str]:
    """The job env with the agent's Prometheus endpoint on ``port`` and a short export cycle."""
    return job_env(
        TRAINGUARD_TELEMETRY_PROMETHEUS_PORT=str(port),
        TRAINGUARD_TELEMETRY_POLL_INTERVAL_S="0.2",
        TRAINGUARD_TELEMETRY_EXPORT_INTERVAL_S="1",
        **extra,
    )


def events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir) if e.get("kind") == kind]


def records(run_dir: Path, rank: int, kind: str) -> list[dict[str, Any]]:
    path = run_dir / "metrics" / f"rank_{rank}.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == kind:
            out.append(rec)
    return out


def logged_keys(run_dir: Path, rank: int = 0) -> set[str]:
    return {k for r in records(run_dir, rank, "log") for k in r}


def restored_steps(run_dir: Path) -> list[tuple[str, int | None]]:
    return [(e.get("source"), e.get("step")) for e in events(run_dir, "checkpoint_restored")]


HANG_TIMEOUT_S = 10


def run_stopped_rank_job(run_dir: Path, script: str, steps: int, framework: str) -> Any:
    """``script`` without its trainguard line (auto-attached to ``framework``), rank 1
    SIGSTOPped inside step 6 (after its heartbeat): the job finished, and its hang was named
    within the hang timeout + 2 s. The finished process."""
    env = job_env(
        TRAINGUARD_CHAOS="hang:rank=1,step=6",
        TRAINGUARD_HEALTH_HANG_TIMEOUT_S=str(HANG_TIMEOUT_S),
    )
    p = run_example(run_dir, script, ["--steps", str(steps), "--no-trainguard"], env=env)
    assert_stopped_rank_named(run_dir, p, framework, timeout_s=HANG_TIMEOUT_S)
    return p


def assert_stopped_rank_named(
    run_dir: Path, p: Any, framework: str, timeout_s: float, *, returncode: int = 0
) -> None:
    """A job auto-attached to ``framework`` whose rank 1 was SIGSTOPped inside a step (chaos
    ``hang:rank=1``) finished (with ``returncode``), and its hang was named within
    ``timeout_s`` + 2 s."""
    assert p.returncode == returncode, p.stderr[-3000:]
    assert f"trainguard: attached to the {framework} Trainer" in p.stderr
    assert events(run_dir, "integration_auto_attached")
    [hang, *_] = events(run_dir, "hang_detected")
    assert hang["ranks"] == [1] and hang["hang_kind"] == "frozen"
    # stopped right at the step's begin: named within the timeout + 2 s of it
    assert hang["per_rank"]["1"]["no_progress_s"] <= timeout_s + 2
    assert "loss" in logged_keys(run_dir, 0)
