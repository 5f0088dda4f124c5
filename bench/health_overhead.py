"""Overhead of in-job health probing on the training path.

``examples/train_mlp.py`` (2 processes, gloo, CPU) under ``trainguard run``, with the agent
probing the node every 1 s vs probing off, in alternating runs; the figure is the median of
the per-step times (``step_time_s`` of every step after the first 10, both ranks) of each run,
then the median over runs. The model is widened (``--dim 256 --hidden 1024 --batch 128``) so a
step is tens of milliseconds rather than 3 ms of noise. The cost of one probe (wall and CPU
milliseconds, measured in-process) is reported too: at one probe per second it bounds the CPU
share the probing takes from the node. A third setting, the whole health component off (no hang/straggler
detection either), is reported for reference. The probes run in the agent process, never in
the workers; what they can cost the workers is CPU time on a shared machine.

    python bench/health_overhead.py [--runs 5 --steps 150]

Prints one JSON line: step_s_probes_off, step_s_probes_on, overhead (on/off - 1),
step_s_health_off, overhead_median_of_pairs, probe_wall_ms, probe_cpu_ms, and details.
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
MODEL = ["--dim", "256", "--hidden", "1024", "--batch", "128"]  # ~tens of ms per step on a CPU
SETTINGS = {
    "probes_off": {"TRAINGUARD_HEALTH_PROBE_INTERVAL_S": "0"},
    "probes_on": {"TRAINGUARD_HEALTH_PROBE_INTERVAL_S": "1"},
    "health_off": {"TRAINGUARD_HEALTH_ENABLED": "false"},
}


def run_once(setting: str, steps: int, root: Path) -> dict[str, float]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_", "TRAINGUARD_"))
    }
    env["PYTHONPATH"] = str(REPO)
    env["TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S"] = "0"
    env.update(SETTINGS[setting])
    run_dir = root / f"{setting}-{time.monotonic_ns()}"
    cmd = [
        sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
        "--tg-run-dir", str(run_dir), str(REPO / "examples" / "train_mlp.py"),
        "--steps", str(steps), "--ckpt-every", "0", *MODEL,
    ]  # fmt: skip
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{setting} run failed: {p.stderr[-2000:]}")
    times = []
    for f in (run_dir / "metrics").glob("rank_*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "step" and rec.get("step", 0) >= 10:
                times.append(rec["step_time_s"])
    probes = sum(
        1
        for line in (run_dir / "events.jsonl").read_text().splitlines()
        if '"health_probe"' in line
    )
    return {"step_s": statistics.median(times), "wall_s": wall, "probe_events": probes}


def probe_cost(reps: int = 50) -> dict[str, float]:
    """Wall and CPU time of one in-job probe (all default sources), in the bench process."""
    from trainguard.core.config.health import HealthConfig
    from trainguard.health.node import NodeProbe, build_sources

    probe = NodeProbe(build_sources(HealthConfig(), checkpoint_dir=tempfile.gettempdir()))
    probe.probe()
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        probe.probe()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    probe.close()
    return {
        "probe_wall_ms": round(statistics.median(wall) * 1e3, 3),
        "probe_cpu_ms": round(statistics.median(cpu) * 1e3, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per setting (alternating)")
    ap.add_argument("--steps", type=int, default=150)
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="tg-health-overhead-") as tmp:
        for i in range(args.runs):
            order = list(SETTINGS) if i % 2 == 0 else list(reversed(SETTINGS))
            for setting in order:
                results[setting].append(run_once(setting, args.steps, Path(tmp)))
    med = {s: statistics.median(r["step_s"] for r in rs) for s, rs in results.items()}
    pair_ratios = [
        on["step_s"] / off["step_s"]
        for on, off in zip(results["probes_on"], results["probes_off"], strict=True)
    ]
    out = {
        "step_s_probes_off": med["probes_off"],
        "step_s_probes_on": med["probes_on"],
        "overhead": med["probes_on"] / med["probes_off"] - 1.0,
        "step_s_health_off": med["health_off"],
        "overhead_median_of_pairs": statistics.median(pair_ratios) - 1.0,
        **probe_cost(),
        "runs": args.runs,
        "steps": args.steps,
        "per_run_step_s": {s: [round(r["step_s"], 6) for r in rs] for s, rs in results.items()},
        "wall_s": {
            s: round(statistics.median(r["wall_s"] for r in rs), 2) for s, rs in results.items()
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
