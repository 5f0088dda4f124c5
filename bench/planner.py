"""Goodput planner benchmark: Daly's published optima, the simulator against the model over a
grid, and the Llama 3.1 reference scenario.

    python bench/planner.py [--job-days 10000] [--seed 0]

Grid: 1k-100k GPUs (8 per node) x node MTBF 5,000 / 20,000 / 50,000 h x two recoveries
(trainguard's measured costs with 4 spares; torchrun-like: blocking saves, no spares, 180 s
mean detection, 600 s requeue; both + 120 s restart at scale) x intervals (the model's optimum,
3x and 10x its disk interval; for trainguard also 5x both intervals, and no spares),
exponential node failures, plus Weibull (shape 0.7) node failures on part of the grid. Each point simulates ``--job-days`` job-days (jobs of 30 MTTIs of training, at
most 10 days, as many copies as it takes); the grid's wall time is measured as a whole.
Ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainguard.plan import JobSpec, Tier, daly_interval, evaluate, optimize  # noqa: E402
from trainguard.plan.defaults import (  # noqa: E402
    reference_scenarios,
    torchrun_like,
    trainguard_like,
)
from trainguard.plan.sim import simulate  # noqa: E402

H = 3600.0


def daly_points() -> dict[str, float]:
    out = {}
    for key, m in (("24h", 24 * 60.0), ("6h", 6 * 60.0), ("15min", 15.0)):
        spec = JobSpec(
            gpus=1,
            mtti_s=m * 60,
            work_s=1e7,
            disk=Tier(interval_s=600.0, stall_s=300.0),
            restart_s=600.0,
            detect_s=0.0,
            node_loss_fraction=0.0,
        )
        out[key] = (daly_interval(5.0, m), optimize(spec).disk.interval_s / 60)
    return out


def grid() -> list[tuple[str, JobSpec]]:
    points = []
    for gpus in (1024, 8192, 16384, 65536, 100000):
        for mtbf_h in (5000.0, 20000.0, 50000.0):
            base = JobSpec(gpus=gpus, node_mtbf_s=mtbf_h * H, node_loss_fraction=0.78)
            work = min(10 * 86400.0, max(H, 30 * base.mtti))
            base = replace(base, work_s=work)
            shapes = (1.0, 0.7) if gpus in (16384, 100000) and mtbf_h == 5000.0 else (1.0,)
            for shape in shapes:
                b = replace(base, weibull_shape=shape)
                tg = replace(trainguard_like(b, extra_restart_s=120.0), spares=4)
                tr = torchrun_like(b, extra_restart_s=120.0)
                for label, spec in (("trainguard", tg), ("torchrun", tr)):
                    best = optimize(spec)
                    d = best.disk.interval_s
                    name = f"{gpus:>6} GPUs {mtbf_h:>7.0f} h k={shape} {label:<10}"
                    points.append((f"{name} opt", best))
                    points.append((f"{name} 3x disk", best.with_intervals(None, d * 3)))
                    points.append((f"{name} 10x disk", best.with_intervals(None, d * 10)))
                    if best.memory is not None:
                        m = best.memory.interval_s
                        points.append((f"{name} 5x both", best.with_intervals(m * 5, d * 5)))
                        points.append((f"{name} 0 spares", replace(best, spares=0)))
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--job-days", type=float, default=10_000.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    daly = daly_points()
    print("Daly (2006) Table 1, checkpoint 5 min, restart 10 min:")
    print(f"  {'MTTI':<6} {'published':>9} {'formula':>8} {'model opt':>9}")
    for (key, (formula, model)), pub in zip(daly.items(), (117, 57, 9.1), strict=True):
        print(f"  {key:<6} {pub:>9} {formula:>8.2f} {model:>9.2f}")

    points = grid()
    rows = []
    t0 = time.perf_counter()
    for i, (name, spec) in enumerate(points):
        model = evaluate(spec).ettr
        sim = simulate(spec, job_days=args.job_days, seed=args.seed + i)
        rows.append((name, spec.mtti, spec.disk.interval_s, model, sim))
    grid_s = time.perf_counter() - t0
    print(f"\nsimulator vs model, {len(rows)} points x {args.job_days:.0f} job-days:")
    print(
        f"  {'point':<48} {'MTTI':>8} {'disk':>8} {'model':>7} {'sim':>7} {'±':>6} {'diff pp':>8}"
    )
    worst = 0.0
    for name, mtti, disk, model, sim in rows:
        diff = 100 * (sim.ettr - model)
        worst = max(worst, abs(diff))
        print(
            f"  {name:<53} {mtti / 60:>6.1f} m {disk:>6.0f} s {100 * model:>7.2f} "
            f"{100 * sim.ettr:>7.2f} {100 * sim.ettr_stderr:>6.2f} {diff:>+8.2f}"
        )
    print(f"grid: {grid_s:.1f} s wall on {os.cpu_count()} cores, max |diff| {worst:.2f} points")

    llama, hlat = reference_scenarios()
    print(f"\n{llama['name']} (published {llama['published']}):")
    for k, p in llama["profiles"].items():
        print(f"  {k:<14} ETTR {100 * p['ettr']:.2f} %  disk every {p['disk_interval_s']:.0f} s")
    print(f"{hlat['name']} (published {hlat['published']}):")
    for k, p in hlat["profiles"].items():
        print(f"  {k:<14} ETTR {100 * p['ettr']:.2f} %")
    print(
        json.dumps(
            {
                "daly_24h_interval_min": round(daly["24h"][1], 2),
                "daly_6h_interval_min": round(daly["6h"][1], 2),
                "daly_15min_interval_min": round(daly["15min"][1], 3),
                "sim_vs_model_max_abs_ettr_diff": round(worst / 100, 5),
                "grid_seconds": round(grid_s, 1),
                "grid_points": len(rows),
                "job_days_per_point": args.job_days,
                "llama3_ettr_torchrun_like": round(llama["profiles"]["torchrun_like"]["ettr"], 4),
                "llama3_ettr_trainguard": round(llama["profiles"]["trainguard"]["ettr"], 4),
                "hlat_ettr_manual": round(hlat["profiles"]["manual"]["ettr"], 4),
                "hlat_ettr_automatic": round(hlat["profiles"]["automatic"]["ettr"], 4),
            }
        )
    )


if __name__ == "__main__":
    main()
