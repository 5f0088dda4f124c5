"""Hang detection latency: a rank stopped with SIGSTOP mid-run, trainguard vs torchrun.

The job is ``tests/health_fixtures/health_worker.py`` (2 processes, gloo all-reduce per step);
rank 1 stops itself with SIGSTOP inside step 8 and writes the time first. trainguard runs with
``[health] hang_timeout_s = 5``: its latency is the ``hang_detected`` event time minus the stop
time (median of ``--runs``). torchrun runs with default settings: its latency is the time until
torchrun notices anything (it exits, or any worker exits); after ``--torchrun-wait`` seconds
(60) without that it is recorded as not detected (``null``, ``torchrun_detected: false``).

    python bench/hang_detect.py [--runs 3 --torchrun-wait 60]

Prints one JSON line: trainguard_detect_s, torchrun_detect_s, and details.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.procs import kill_tree  # noqa: E402  (ends workers in their own sessions, by PID)

WORKER = REPO / "tests" / "health_fixtures" / "health_worker.py"
WORKER_ARGS = [
    "--steps",
    "100",
    "--compute-s",
    "0.05",
    "--sleep",
    "--stop-rank",
    "1",
    "--stop-at-step",
    "8",
]
TIMEOUT_S = 5.0


def base_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_", "TRAINGUARD_"))
    }
    env["PYTHONPATH"] = str(REPO)
    return env


def trainguard_once(root: Path) -> float | None:
    run_dir = root / f"tg-{time.monotonic_ns()}"
    env = base_env()
    env.update(
        TRAINGUARD_HEALTH_HANG_TIMEOUT_S=str(TIMEOUT_S),
        TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0",
    )
    cmd = [
        sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
        "--tg-run-dir", str(run_dir), str(WORKER), *WORKER_ARGS,
    ]  # fmt: skip
    p = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        p.wait(timeout=300)
    except subprocess.TimeoutExpired:
        pass
    finally:
        # The SIGSTOPped worker (and any other) is ended by PID even if trainguard did not.
        kill_tree(p)
    stopped = float((run_dir / "stopped_at").read_text())
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev["kind"] == "hang_detected":
            return ev["time"] - stopped
    print(f"trainguard did not report a hang (rc {p.returncode})", file=sys.stderr)
    return None


def torchrun_once(root: Path, wait_s: float) -> tuple[float | None, str]:
    run_dir = root / f"torchrun-{time.monotonic_ns()}"
    env = base_env()
    env["TRAINGUARD_RUNTIME_RUN_DIR"] = str(run_dir)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(WORKER), *WORKER_ARGS,
    ]  # fmt: skip
    p = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        marker = run_dir / "stopped_at"
        while not marker.exists():
            if time.monotonic() > deadline or p.poll() is not None:
                raise RuntimeError("torchrun job did not reach the stop")
            time.sleep(0.05)
        time.sleep(0.05)
        stopped = float(marker.read_text())
        while time.time() - stopped < wait_s:
            if p.poll() is not None:
                return time.time() - stopped, f"torchrun exited with {p.returncode}"
            time.sleep(0.1)
        return None, f"not detected after {wait_s:g} s (torchrun still waiting)"
    finally:
        # torchrun never ends the stopped worker; it runs in a session of its own, so a
        # process-group kill misses it: end the whole tree by PID.
        kill_tree(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--torchrun-wait", type=float, default=60.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tg-hang-") as tmp:
        root = Path(tmp)
        tg = [trainguard_once(root) for _ in range(args.runs)]
        tr, note = torchrun_once(root, args.torchrun_wait)
    found = [t for t in tg if t is not None]
    out = {
        "trainguard_detect_s": round(statistics.median(found), 3) if found else None,
        "torchrun_detect_s": None if tr is None else round(tr, 3),
        "torchrun_detected": tr is not None,
        "torchrun_note": note,
        "torchrun_wait_s": args.torchrun_wait,
        "hang_timeout_s": TIMEOUT_S,
        "trainguard_runs_s": [None if t is None else round(t, 3) for t in tg],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
