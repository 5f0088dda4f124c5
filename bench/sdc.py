"""Silent data corruption: found, named, rolled back (real DDP jobs, gloo on CPU).

    PYTHONPATH=$PWD .venv/bin/python bench/sdc.py [--runs 10] [--worlds 4,2] [--steps 160]
    PYTHONPATH=$PWD .venv/bin/python bench/sdc.py --fault-free-minutes 30

``--fault-free-minutes M`` instead runs fault-free jobs back to back (the world sizes in turn,
the default cadence, disk and memory-tier saves) for M minutes and counts the checks made and
the ``sdc_suspect`` events (there must be none): the false-alarm figure, under whatever else
loads the machine.

For each world size: one fault-free run (the reference weights), then ``--runs`` runs of
``examples/train_mlp.py`` under ``trainguard run`` with one bit of one rank's gradient flipped
(``TRAINGUARD_CHAOS='sdc:...'``: after DDP's all-reduce, in the optimizer step) at a random
step, element and bit. Per run: whether a disagreement was found (``sdc_suspect``), whether the
verdict named the flipped rank, the steps from the flip to the check that found it (and the
cadence agreed then), the checkpoints committed from state written between the flip and the
rollback, and whether the final weights equal the fault-free run's bitwise. Then one fault-free
run without persisting saves gives the checks' share of the training time at the default
cadence (``sdc_check_overhead``). Ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _checks(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics" / "rank_0.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        rec = json.loads(line)
        if rec.get("kind") == "sdc_check":
            out.append(rec)
    return out


def run_job(
    run_dir: Path, world: int, steps: int, ckpt_every: int, chaos: str | None
) -> tuple[int, float]:
    # each run's own fleet database (the verdicts' records), in its run directory: sdc counts
    # toward the lemon policy, so one shared database would refuse this machine after three
    # injected corruptions
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRAINGUARD_RUNTIME_RUNS_ROOT=str(run_dir))
    env.pop("TRAINGUARD_CHAOS", None)
    if chaos:
        env["TRAINGUARD_CHAOS"] = chaos
    cmd = [
        sys.executable, "-m", "trainguard", "run", "--standalone",
        "--nproc-per-node", str(world), "--tg-run-dir", str(run_dir),
        str(ROOT / "examples" / "train_mlp.py"), "--steps", str(steps),
        "--ckpt-every", str(ckpt_every), "--out", str(run_dir / "final.pt"),
    ]  # fmt: skip
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-3000:])
    return p.returncode, time.monotonic() - t0


def same_weights(a: Path, b: Path) -> bool:
    if not (a.exists() and b.exists()):
        return False
    wa = torch.load(a, weights_only=True)
    wb = torch.load(b, weights_only=True)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def fault_run(
    tmp: Path, world: int, i: int, args: argparse.Namespace, rng: random.Random, ref: Path
) -> dict[str, Any]:
    rank = rng.randrange(world)
    flip = rng.randrange(5, args.steps - 60)
    bit, param, index = rng.randrange(8, 29), rng.randrange(4), rng.randrange(64)
    spec = f"sdc:rank={rank},step={flip},bit={bit},param={param},index={index}"
    run_dir = tmp / f"w{world}-run{i}"
    rc, wall = run_job(run_dir, world, args.steps, args.ckpt_every, spec)
    events = _events(run_dir)
    suspects = [e for e in events if e["kind"] == "sdc_suspect"]
    verdicts = [e for e in events if e["kind"] == "sdc_verdict" and e.get("ranks")]
    rollback = next((e for e in events if e["kind"] == "sdc_rollback"), None)
    first = suspects[0] if suspects else None
    # the corrupted state is the one after step ``flip``'s optimizer step: the boundary of the
    # steps done, flip + 1, is the first one that can see it
    detect = first["step"] - (flip + 1) + 1 if first else None
    cadence = None
    if first is not None:
        before = [c for c in _checks(run_dir) if c["step"] < first["step"]]
        cadence = before[-1]["next_step"] - before[-1]["step"] if before else None
    until = rollback["time"] if rollback else float("inf")
    corrupted = [
        e["step"]
        for e in events
        if e["kind"] == "checkpoint_committed" and e["step"] > flip and e["time"] <= until
    ]
    out = {
        "world": world,
        "spec": spec,
        "rc": rc,
        "wall_s": round(wall, 1),
        "detected": first is not None,
        "named": verdicts[0]["ranks"] if verdicts else [],
        "named_correct": bool(verdicts) and verdicts[0]["ranks"] == [rank],
        "localise": verdicts[0].get("localise") if verdicts else None,
        "detect_steps": detect,
        "cadence": cadence,
        "corrupted_committed": len(corrupted),
        "bitwise_equal": same_weights(run_dir / "final.pt", ref),
    }
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def fault_free(tmp: Path, worlds: list[int], minutes: float, args: argparse.Namespace) -> None:
    """Fault-free jobs back to back for ``minutes``: the checks made, the false suspects."""
    deadline = time.monotonic() + 60 * minutes
    jobs: list[dict[str, Any]] = []
    i = 0
    while time.monotonic() < deadline:
        world = worlds[i % len(worlds)]
        run_dir = tmp / f"ff{i}-w{world}"
        rc, wall = run_job(run_dir, world, args.fault_free_steps, args.ckpt_every, None)
        events = _events(run_dir)
        checks = _checks(run_dir)
        job = {
            "job": i,
            "world": world,
            "rc": rc,
            "wall_s": round(wall, 1),
            "checks": len(checks),
            "sdc_suspect": sum(1 for e in events if e["kind"] == "sdc_suspect"),
            "sdc_verdict": sum(1 for e in events if e["kind"] == "sdc_verdict"),
        }
        jobs.append(job)
        print(json.dumps(job), file=sys.stderr, flush=True)
        i += 1
    print(json.dumps({
        "bench": "sdc-fault-free",
        "minutes": minutes,
        "worlds": worlds,
        "jobs": len(jobs),
        "jobs_failed": sum(1 for j in jobs if j["rc"] != 0),
        "steps": len(jobs) * args.fault_free_steps,
        "sdc_checks": sum(j["checks"] for j in jobs),
        "false_sdc_suspect": sum(j["sdc_suspect"] for j in jobs),
        "false_sdc_verdict": sum(j["sdc_verdict"] for j in jobs),
        "run_dir": str(tmp),
    }))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--worlds", default="4,2")
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--ckpt-every", type=int, default=40)
    p.add_argument("--overhead-steps", type=int, default=1500)
    p.add_argument("--seed", type=int, default=50)
    p.add_argument("--fault-free-minutes", type=float, default=0.0)
    p.add_argument("--fault-free-steps", type=int, default=3000)
    args = p.parse_args()
    rng = random.Random(args.seed)
    worlds = [int(w) for w in args.worlds.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-sdc-"))
    if args.fault_free_minutes > 0:
        fault_free(tmp, worlds, args.fault_free_minutes, args)
        return
    runs: list[dict[str, Any]] = []
    false_suspects = 0
    for world in worlds:
        ref_dir = tmp / f"w{world}-clean"
        rc, _ = run_job(ref_dir, world, args.steps, args.ckpt_every, None)
        false_suspects += sum(1 for e in _events(ref_dir) if e["kind"] == "sdc_suspect")
        for i in range(args.runs):
            runs.append(fault_run(tmp, world, i, args, rng, ref_dir / "final.pt"))
    overhead: dict[int, dict[str, Any]] = {}
    for world in worlds:  # the checks' (and with two ranks the per-step records') share
        over_dir = tmp / f"overhead-w{world}"
        run_job(over_dir, world, args.overhead_steps, 10**9, None)
        false_suspects += sum(1 for e in _events(over_dir) if e["kind"] == "sdc_suspect")
        checks = _checks(over_dir)
        if checks:
            overhead[world] = {**checks[-1], "checks": len(checks)}
    steps = [r["detect_steps"] for r in runs if r["detect_steps"] is not None]
    result: dict[str, Any] = {"bench": "sdc", "runs_per_world": args.runs, "worlds": worlds}
    for world in worlds:
        mine = [r for r in runs if r["world"] == world]
        d = [r["detect_steps"] for r in mine if r["detect_steps"] is not None]
        result[f"w{world}"] = {
            "sdc_detected": f"{sum(r['detected'] for r in mine)}/{len(mine)}",
            "sdc_rank_named_correct": f"{sum(r['named_correct'] for r in mine)}/{len(mine)}",
            "sdc_detect_steps_median": statistics.median(d) if d else None,
            "sdc_detect_steps_max": max(d) if d else None,
            "check_cadence_max": max((r["cadence"] or 0) for r in mine) if mine else None,
            "detect_within_cadence_plus_1": sum(
                1
                for r in mine
                if r["detect_steps"] is not None
                and r["cadence"] is not None
                and r["detect_steps"] <= r["cadence"] + 1
            ),  # fmt: skip
            "corrupted_checkpoints_committed": sum(r["corrupted_committed"] for r in mine),
            "final_bitwise_equal": f"{sum(r['bitwise_equal'] for r in mine)}/{len(mine)}",
            "localised_by": sorted({str(r["localise"]) for r in mine}),
        }
    result.update(
        sdc_detect_steps_median=statistics.median(steps) if steps else None,
        sdc_detect_steps_max=max(steps) if steps else None,
        # the checks' share of the training time at the default cadence, with two ranks
        # including the per-step parameter records (charged to the same budget); the
        # largest over the world sizes
        sdc_check_overhead=max((round(o["overhead"], 5) for o in overhead.values()), default=None),
        sdc_check_overhead_per_world={
            f"w{w}": round(o["overhead"], 5) for w, o in overhead.items()
        },
        # the checks only a memory-tier snapshot asked for: the memory tier's cadence counts
        # them in the snapshot's cost (its own budget)
        sdc_forced_check_overhead=max(
            (round(o.get("forced_overhead", 0.0), 5) for o in overhead.values()), default=None
        ),
        # two ranks: the parameters' digest recorded at every boundary for the replay
        sdc_record_overhead_w2=round(overhead[2]["record_overhead"], 5) if 2 in overhead else None,
        sdc_checks_in_overhead_run={f"w{w}": o["checks"] for w, o in overhead.items()},
        overhead_run_steps=args.overhead_steps,
        false_sdc_suspect=false_suspects,
        run_dir=str(tmp),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
