"""``trainguard plan``: goodput planner. What ETTR will this job get, and which checkpoint
intervals and how many spare nodes should it use? Costs default to trainguard's own measured
numbers (see the table in ``--html``), or to a real run's (``--from-run RUN_DIR``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainguard.core.atomicfile import write_atomic

HOUR = 3600.0

# flag -> (JobSpec field or tier field, scale to seconds)
RATE_FLAGS = {"mtti_h": "--mtti-h", "node_mtbf_h": "--node-mtbf-h"}
COST_FLAGS = {
    "job_days": "--job-days",
    "step_s": "--step-s",
    "memory_interval_s": "--memory-interval-s",
    "disk_interval_s": "--disk-interval-s",
    "memory_stall_s": "--memory-stall-s",
    "memory_commit_s": "--memory-commit-s",
    "memory_restore_s": "--memory-restore-s",
    "disk_stall_s": "--disk-stall-s",
    "disk_commit_s": "--disk-commit-s",
    "disk_restore_s": "--disk-restore-s",
    "restart_s": "--restart-s",
    "detect_s": "--detect-s",
    "startup_s": "--startup-s",
    "swap_s": "--swap-s",
    "requeue_s": "--requeue-s",
    "node_loss_fraction": "--node-loss-fraction",
    "weibull_shape": "--weibull-shape",
}


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--gpus", type=int, default=None, help="GPUs of the job (default 16384)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default 8")
    p.add_argument("--mtti-h", type=float, default=None, help="job mean time to interruption, h")
    p.add_argument("--node-mtbf-h", type=float, default=None, help="one node's MTBF, hours")
    p.add_argument("--job-days", type=float, default=None, help="training time needed (days)")
    p.add_argument(
        "--step-s", type=float, default=None, help="step time (memory interval in steps)"
    )
    p.add_argument("--memory-interval-s", type=float, default=None,
                   help="evaluate this memory interval instead of optimising")  # fmt: skip
    p.add_argument("--disk-interval-s", type=float, default=None,
                   help="evaluate this disk interval instead of optimising")  # fmt: skip
    p.add_argument("--no-memory-tier", action="store_true", help="disk checkpoints only")
    p.add_argument("--no-peer-replication", action="store_true",
                   help="the memory tier does not survive a node loss")  # fmt: skip
    for name in ("memory", "disk"):
        for what in ("stall", "commit", "restore"):
            p.add_argument(f"--{name}-{what}-s", type=float, default=None)
    p.add_argument("--restart-s", type=float, default=None, help="restart cost (restore excluded)")
    p.add_argument("--detect-s", type=float, default=None, help="failure detection latency")
    p.add_argument("--startup-s", type=float, default=None, help="one-time start-up")
    p.add_argument("--spares", type=int, default=None, help="spare nodes (default: recommended)")
    p.add_argument("--swap-s", type=float, default=None, help="time to swap a spare in")
    p.add_argument("--requeue-s", type=float, default=None, help="requeue when spares run out")
    p.add_argument("--node-loss-fraction", type=float, default=None,
                   help="share of interruptions that take a node out (default 1)")  # fmt: skip
    p.add_argument("--profile", choices=("trainguard", "torchrun"), default="trainguard",
                   help="default costs: trainguard's measured ones or torchrun-like recovery")  # fmt: skip
    p.add_argument("--weibull-shape", type=float, default=None, help="simulator only")
    p.add_argument("--simulate-days", type=float, default=0.0,
                   help="also run the simulator for this many job-days at the recommendation")  # fmt: skip
    p.add_argument("--from-run", metavar="RUN_DIR", default=None,
                   help="take the costs from a real run and check the model against it")  # fmt: skip
    p.add_argument("--no-scenarios", action="store_true", help="skip Llama 3.1 / HLAT")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--html", metavar="OUT", default=None, help="write the HTML page here")
    return p


def _check_numbers(args: argparse.Namespace) -> None:
    for key, flag in RATE_FLAGS.items():
        v = getattr(args, key)
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{flag} must be > 0 (a failure rate cannot be negative), got {v}")
    for key, flag in COST_FLAGS.items():
        v = getattr(args, key)
        if v is not None and not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{flag} must be a finite number >= 0, got {v}")
    for key, flag in (("gpus", "--gpus"), ("gpus_per_node", "--gpus-per-node")):
        v = getattr(args, key)
        if v is not None and v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if args.spares is not None and args.spares < 0:
        raise ValueError(f"--spares must be >= 0, got {args.spares}")
    if args.node_loss_fraction is not None and args.node_loss_fraction > 1:
        raise ValueError(f"--node-loss-fraction must be in [0, 1], got {args.node_loss_fraction}")
    for key, flag in (("memory_interval_s", "--memory-interval-s"),
                      ("disk_interval_s", "--disk-interval-s"), ("weibull_shape", "--weibull-shape")):  # fmt: skip
        v = getattr(args, key)
        if v is not None and v <= 0:
            raise ValueError(f"{flag} must be > 0, got {v}")


def _spec(args: argparse.Namespace, run_spec: Any) -> Any:
    from trainguard.plan.defaults import default_spec, torchrun_like
    from trainguard.plan.model import JobSpec, Tier

    if run_spec is not None:
        base = run_spec
        if args.gpus is not None or args.mtti_h is not None or args.node_mtbf_h is not None:
            # the run's costs for a job at another scale: a long job, node losses, the
            # failure rate given (or Llama 3.1's 2.5 h MTTI)
            mtbf = args.node_mtbf_h * HOUR if args.node_mtbf_h is not None else None
            mtti = args.mtti_h * HOUR if args.mtti_h is not None else None
            base = replace(base, gpus=args.gpus or 16384, gpus_per_node=args.gpus_per_node or 8,
                           work_s=10 * 86400.0, startup_s=0.0, node_loss_fraction=1.0,
                           peer_replication=True, node_mtbf_s=mtbf,
                           mtti_s=mtti if mtti or mtbf else 2.5 * HOUR)  # fmt: skip
    else:
        base = default_spec(gpus=args.gpus or 16384, mtti_s=2.5 * HOUR)
        if args.profile == "torchrun":
            base = torchrun_like(base)
    if args.gpus is not None or run_spec is None:
        base = replace(base, gpus=args.gpus or base.gpus)
    if args.gpus_per_node is not None:
        base = replace(base, gpus_per_node=args.gpus_per_node)
    if args.mtti_h is not None:
        base = replace(base, mtti_s=args.mtti_h * HOUR, node_mtbf_s=None)
    elif args.node_mtbf_h is not None:
        base = replace(base, node_mtbf_s=args.node_mtbf_h * HOUR, mtti_s=None)
    elif base.mtti_s is None and base.node_mtbf_s is None:
        base = replace(base, mtti_s=2.5 * HOUR)
    fields: dict[str, Any] = {}
    for key in ("restart_s", "detect_s", "startup_s", "swap_s", "requeue_s", "spares",
                "node_loss_fraction", "weibull_shape", "step_s"):  # fmt: skip
        if getattr(args, key) is not None:
            fields[key] = getattr(args, key)
    if args.job_days is not None:
        fields["work_s"] = args.job_days * 86400.0
    if args.no_peer_replication:
        fields["peer_replication"] = False
    mem = base.memory
    if args.no_memory_tier:
        mem = None
    elif mem is None and any(
        getattr(args, f"memory_{w}") is not None for w in ("stall_s", "commit_s", "restore_s")
    ):
        mem = Tier(interval_s=30.0, stall_s=0.05)
    if mem is not None:
        mem = replace(mem, **{w: getattr(args, f"memory_{w}") for w in
                              ("interval_s", "stall_s", "commit_s", "restore_s")
                              if getattr(args, f"memory_{w}") is not None})  # fmt: skip
    disk = replace(base.disk, **{w: getattr(args, f"disk_{w}") for w in
                                 ("interval_s", "stall_s", "commit_s", "restore_s")
                                 if getattr(args, f"disk_{w}") is not None})  # fmt: skip
    return JobSpec(**{**{k: getattr(base, k) for k in base.__dataclass_fields__},
                      "memory": mem, "disk": disk, **fields})  # fmt: skip


def _flagged(msg: str) -> str:
    for field, flag in (
        ("memory interval", "--memory-interval-s"),
        ("disk interval", "--disk-interval-s"),
    ):
        if msg.startswith(field):
            return f"{msg} ({flag})"
    return msg


def _answer(args: argparse.Namespace, spec: Any, run_info: Any, run_spec: Any) -> dict[str, Any]:
    """The plan for ``spec`` (plus the run's check and the simulation when asked)."""
    from trainguard.plan.model import evaluate
    from trainguard.plan.report import build_plan

    fixed = args.memory_interval_s is not None or args.disk_interval_s is not None
    plan = build_plan(
        spec,
        fixed_intervals=fixed,
        recommend=args.spares is None,
        scenarios=not args.no_scenarios,
    )
    if run_info is not None:
        if run_spec is not None:
            run_info["model_expected_failures_ettr"] = evaluate(run_spec).ettr
        plan["run"] = run_info
    if args.simulate_days > 0:
        from trainguard.plan.model import JobSpec
        from trainguard.plan.sim import simulate

        rec = plan["recommendation"]
        best = JobSpec(**{**{k: getattr(spec, k) for k in spec.__dataclass_fields__},
                          "spares": rec["spares"]})  # fmt: skip
        best = best.with_intervals(rec["memory_interval_s"], rec["disk_interval_s"])
        res = simulate(best, job_days=args.simulate_days, seed=0)
        plan["simulation"] = {**res.to_dict(), "model_ettr": rec["ettr"],
                              "diff_pp": 100 * (res.ettr - rec["ettr"])}  # fmt: skip
    return plan


def main(argv: list[str], *, prog: str = "trainguard plan") -> int:
    args = _parser(prog).parse_args(argv)
    try:
        _check_numbers(args)
        run_info = None
        run_spec = None
        if args.from_run is not None:
            from trainguard.plan.fromrun import read_run
            from trainguard.plan.fromrun import run_spec as make_run_spec
            from trainguard.plan.model import evaluate_counted

            run_dir = Path(args.from_run)
            if not run_dir.is_dir():
                raise ValueError(f"--from-run {run_dir}: not a directory")
            costs = read_run(run_dir)
            run_spec = make_run_spec(costs)
            counted = evaluate_counted(run_spec, costs.failures)
            run_info = {
                "run_dir": str(run_dir),
                "measured_ettr": costs.measured_ettr,
                "model_ettr": counted.ettr,
                "model_expected_failures_ettr": None,
                "failures": costs.failures,
                "costs": costs.to_dict(),
                "model": counted.to_dict(),
            }
        spec = _spec(args, run_spec)
    except ValueError as e:
        print(f"{prog}: error: {_flagged(str(e))}", file=sys.stderr)
        return 2
    from trainguard.plan.report import render_html, render_text

    try:
        plan = _answer(args, spec, run_info, run_spec)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.html:
        try:
            write_atomic(args.html, render_html(plan))
        except OSError as e:
            print(f"{prog}: error: cannot write {args.html}: {e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(plan, default=float))
    else:
        print(render_text(plan))
        if "simulation" in plan:
            s = plan["simulation"]
            print(f"simulator: ETTR {100 * s['ettr']:.2f} % over {s['job_days']:.0f} job-days "
                  f"({s['diff_pp']:+.2f} points from the model)")  # fmt: skip
        if args.html:
            print(f"wrote {args.html}")
    return 0
