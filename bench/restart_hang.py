"""Restart reliability: a 2-process job, one worker kill -9'ed mid-run, --max-restarts 3.

Runs the same job N times under torchrun and under trainguard run (alternating) and counts
runs that finish, fail, or hang (no exit within --timeout). Ends with one JSON line:
{"runs", "torchrun_ok", "torchrun_hung", "torchrun_failed", "trainguard_ok", "trainguard_hung",
"trainguard_failed"}.

    python bench/restart_hang.py [--runs 20] [--timeout 90]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = str(REPO / "examples" / "train_mlp.py")
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "trainguard": [sys.executable, "-m", "trainguard", "run"],
}


def once(which: str, i: int, tmp: Path, timeout: float) -> str:
    cmd = LAUNCHERS[which] + ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3"]
    if which == "trainguard":
        cmd += ["--tg-run-dir", str(tmp / f"run{i}")]
    cmd += [EXAMPLE, "--steps", "12", "--fail-at-step", str(3 + i % 6), "--fail-rank", str(i % 2)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen(
        cmd,
        env=env,
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        return "ok" if p.wait(timeout=timeout) == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        return "hung"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=90.0)
    ap.add_argument("--only", choices=list(LAUNCHERS), default=None)
    args = ap.parse_args()
    which_all = [args.only] if args.only else list(LAUNCHERS)
    counts = {w: {"ok": 0, "failed": 0, "hung": 0} for w in which_all}
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.runs):
            for w in which_all if i % 2 == 0 else reversed(which_all):
                outcome = once(w, i, Path(d), args.timeout)
                counts[w][outcome] += 1
                print(f"run {i:>2} {w:<10} {outcome}", flush=True)
    print(f"{'launcher':<12} {'ok':>4} {'failed':>7} {'hung':>5}")
    for w, c in counts.items():
        print(f"{w:<12} {c['ok']:>4} {c['failed']:>7} {c['hung']:>5}")
    out: dict[str, int] = {"runs": args.runs}
    for w, c in counts.items():
        for k, v in c.items():
            out[f"{w}_{k}"] = v
    print(json.dumps(out))


if __name__ == "__main__":
    main()
