"""Launch-to-first-step: torchrun vs trainguard run on the same 2-process gloo script.

Alternates the launchers, reports medians, ends with one JSON line:
{"torchrun_first_step_s", "trainguard_first_step_s", "ratio"}.

    python bench/launch.py [--repeats 7]
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

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "first_step_worker.py")
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "trainguard": [sys.executable, "-m", "trainguard", "run"],
}


def once(which: str, tmp: Path) -> float:
    marker = tmp / f"{which}.t"
    marker.unlink(missing_ok=True)
    env = dict(os.environ, FIRST_STEP_FILE=str(marker), PYTHONPATH=str(HERE.parent))
    cmd = LAUNCHERS[which] + ["--standalone", "--nproc-per-node", "2"]
    if which == "trainguard":
        cmd += ["--tg-run-dir", str(tmp / "run")]
    t0 = time.time()
    subprocess.run(cmd + [WORKER], env=env, cwd=tmp, check=True, capture_output=True, timeout=300)
    return float(marker.read_text()) - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    samples: dict[str, list[float]] = {k: [] for k in LAUNCHERS}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        once("torchrun", tmp)  # warm the page cache for both
        for i in range(args.repeats):
            order = list(LAUNCHERS) if i % 2 == 0 else list(reversed(LAUNCHERS))
            for which in order:
                samples[which].append(once(which, tmp))
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"{'launcher':<12} {'median s':>9}   samples")
    for k, v in samples.items():
        print(f"{k:<12} {med[k]:>9.3f}   {' '.join(f'{x:.2f}' for x in v)}")
    ratio = med["trainguard"] / med["torchrun"]
    print(f"trainguard / torchrun = {ratio:.3f} (target <= 1.1)")
    print(
        json.dumps(
            {
                "torchrun_first_step_s": round(med["torchrun"], 3),
                "trainguard_first_step_s": round(med["trainguard"], 3),
                "ratio": round(ratio, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
