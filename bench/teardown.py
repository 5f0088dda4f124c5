"""Restart teardown: how long after a failure the restarted group starts, torchrun vs trainguard.

Two ranks; on the first attempt rank 1 exits 1 while rank 0 is inside a 120 s step;
``--max-restarts 1``. Both launchers run the same script (bench/teardown_worker.py), which uses
trainguard's checkpoints and so its preemption handlers. torchrun tears the failed group down
with SIGTERM and waits ``--shutdown-timeout`` (30 s) before SIGKILL; the survivor treats the
SIGTERM as a preemption notice and keeps running its step. trainguard tells the worker that
the SIGTERM is a teardown for a restart, and the survivor exits at once.

    python bench/teardown.py [--runs 3]

Prints a table and ends with one JSON line: torchrun_teardown_s, trainguard_teardown_s (medians,
seconds from the failure to the first rank of the restarted group starting).
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
from trainguard.chaos.procs import kill_tree  # noqa: E402

WORKER = REPO / "bench" / "teardown_worker.py"
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "trainguard": [sys.executable, "-m", "trainguard", "run"],
}


def once(which: str, root: Path) -> float | None:
    d = root / f"{which}-{time.monotonic_ns()}"
    out = d / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO)
    env["TRAINGUARD_RUNTIME_RUN_DIR"] = str(d / "run")
    cmd = [
        *LAUNCHERS[which], "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        str(WORKER), "--out", str(out),
    ]  # fmt: skip
    p = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        p.wait(timeout=200)
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill_tree(p)
    try:
        failed = float((out / "failed_at").read_text())
    except OSError:
        return None
    starts = [float(f.read_text()) for f in out.glob("started_1_*")]
    return min(starts) - failed if starts else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    times: dict[str, list[float | None]] = {"torchrun": [], "trainguard": []}
    with tempfile.TemporaryDirectory(prefix="tg-teardown-") as tmp:
        for _ in range(args.runs):  # alternate, so both see the same machine load
            for which in times:
                times[which].append(once(which, Path(tmp)))
    med = {}
    print(f"{'launcher':<12} {'median s':>9}  runs")
    for which, ts in times.items():
        ok = [t for t in ts if t is not None]
        med[which] = round(statistics.median(ok), 3) if ok else None
        runs = ", ".join("-" if t is None else f"{t:.2f}" for t in ts)
        print(f"{which:<12} {med[which]!s:>9}  {runs}")
    print(
        json.dumps(
            {
                "torchrun_teardown_s": med["torchrun"],
                "trainguard_teardown_s": med["trainguard"],
                "runs": args.runs,
                "torchrun_runs_s": times["torchrun"],
                "trainguard_runs_s": times["trainguard"],
            }
        )
    )


if __name__ == "__main__":
    main()
