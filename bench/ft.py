"""torchft mode: torchft alone vs ``trainguard run --ft``, same DDP toy, same fault.

Two replica groups of examples/ft_ddp.py (one process each, gloo, 50 ms steps); group 1's
worker is kill -9'd ``--kills`` times (its launcher restarts it and it heals from group 0).
torchft alone: ``torchft_lighthouse`` + one ``torchrun`` per group, torchft's own
``DistributedDataParallel``/``OptimizerWrapper``. trainguard: ``trainguard run --ft`` per group
(the first starts the lighthouse, same timeouts: heartbeat 1000 ms, join 100 ms, tick 50 ms),
``tg.ft_wrap``. Per kill: the survivor's pause (longest gap between its committed steps from
the last one before the kill to its first one without the dead group); survivor crashes (its
worker restarted). Ends with one JSON line: ``torchft_pause_s``, ``trainguard_ft_pause_s``
(medians over the kills), ``torchft_survivor_crashes``, ``trainguard_ft_survivor_crashes``.

    PYTHONPATH=. python bench/ft.py [--kills 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._support import base_env  # noqa: E402
from trainguard.testing.ft import FTResult, run_kills  # noqa: E402


def _fmt(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=180.0, help="per wait (s)")
    ap.add_argument("--modes", default="torchft,trainguard")
    args = ap.parse_args()
    results: dict[str, FTResult] = {}
    took: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ft-") as tmp:
        for mode in args.modes.split(","):
            t0 = time.monotonic()
            results[mode] = run_kills(
                mode, Path(tmp) / mode, kills=args.kills, timeout_s=args.timeout, env=base_env()
            )
            took[mode] = time.monotonic() - t0
            r = results[mode]
            print(
                f"{mode}: {len(r.pauses_s)} kills, survivor crashes {r.survivor_crashes}, "
                f"pause {_fmt(r.pauses_s)} s, {took[mode]:.0f} s",
                flush=True,
            )
    print()
    print(f"{'mode':<12} {'kills':>5} {'crashes':>8} {'pause s median (min-max)':>26} {'eq w':>5}")
    for mode, r in results.items():
        print(
            f"{mode:<12} {len(r.pauses_s):>5} {r.survivor_crashes:>8} "
            f"{_fmt(r.pauses_s):>26} {str(r.weights_equal):>5}"
        )
    out: dict[str, object] = {"kills": args.kills}
    names = {"torchft": "torchft", "trainguard": "trainguard_ft"}
    for mode, r in results.items():
        out[f"{names[mode]}_pause_s"] = round(r.pause_median_s, 3) if r.pauses_s else None
        out[f"{names[mode]}_survivor_crashes"] = r.survivor_crashes
        out[f"{names[mode]}_kills_done"] = len(r.pauses_s)
        out[f"{names[mode]}_weights_equal"] = r.weights_equal
    print(json.dumps(out))


if __name__ == "__main__":
    main()
