"""``trainguard slurm <status|agent|finish>``: trainguard jobs on Slurm.

trainguard slurm status JOB [--run-dir DIR] [--json]
    active nodes, spares, drained nodes with reasons, restarts, last checkpoint
trainguard slurm agent [trainguard run options] script.py [args]
    (in the batch script, one per node through srun) ``trainguard run`` with this node's
    Slurm identity: SLURMD_NODENAME names the node in events and telemetry; the node that
    hosts the c10d rendezvous store is the allocation's first. On the other nodes than the
    batch host it watches the batch beacon: when the batch host is lost, one agent resubmits
    the job without it and cancels this one (trainguard.slurm.finish.take_over)
trainguard slurm roles [trainguard run options] script.py [args]
    (in the batch script, one per node of the roles with ``nodes = K``, in a step of their own)
    start and supervise the role replicas placed on this node, until the trainer is done
    (trainguard.roles.node)
trainguard slurm finish --run-dir DIR --rc RC --since T --script FILE [--config TOML]
    (in the batch script, after the step) requeue, resubmit without lost nodes, or end
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from trainguard.chaos.faults import CHAOS_ENV
from trainguard.core.config import ConfigError, load_config
from trainguard.core.contracts import envvars
from trainguard.core.procs import exit_now

if TYPE_CHECKING:
    from trainguard.slurm.batchhost import BatchBeaconWatch

__all__ = ["main"]


def _with_is_host(argv: list[str], is_host: bool) -> list[str]:
    """Add ``is_host=...`` to the ``--rdzv-conf`` value (or add the option)."""
    out = list(argv)
    flag = f"is_host={'true' if is_host else 'false'}"
    for i, tok in enumerate(out):
        if tok in ("--rdzv-conf", "--rdzv_conf") and i + 1 < len(out):
            out[i + 1] = f"{out[i + 1]},{flag}" if out[i + 1] else flag
            return out
        if tok.startswith(("--rdzv-conf=", "--rdzv_conf=")):
            out[i] = f"{tok},{flag}"
            return out
    return ["--rdzv-conf", flag, *out]


def _agent(argv: list[str], prog: str) -> int:
    env = os.environ
    job = env.get("SLURM_JOB_ID")
    node = env.get("SLURMD_NODENAME")
    if not job or not node:
        print(
            f"{prog}: error: runs inside a Slurm job step (srun): SLURM_JOB_ID/SLURMD_NODENAME "
            "are not set; use 'trainguard sbatch' or 'trainguard run'",
            file=sys.stderr,
        )
        return 2
    rerun = env.get("SLURM_RESTART_COUNT", "0") not in ("", "0")
    if rerun and env.get(CHAOS_ENV):
        # a requeued job keeps its environment and starts from attempt 0 again: the faults
        # would fire once more in every requeue
        del os.environ[CHAOS_ENV]
        print(
            f"{prog}: {CHAOS_ENV} ignored: job {job} is a requeue (restart "
            f"{env['SLURM_RESTART_COUNT']}); faults are injected in a job's first run only",
            file=sys.stderr,
            flush=True,
        )
    rdzv_node = env.get(envvars.SBATCH_RDZV_NODE)
    if rdzv_node:
        # All nodes of a test cluster may share one address: say which one hosts the store.
        argv = _with_is_host(argv, node == rdzv_node)
    print(
        f"{prog}: node {node} (SLURM_NODEID {env.get('SLURM_NODEID', '?')}) of job {job}"
        + (f", rendezvous on {rdzv_node}" if rdzv_node else ""),
        file=sys.stderr,
        flush=True,
    )
    from trainguard.cli import cmd_run

    watch = _watch_batch_host(dict(env), node, prog)
    try:
        code = cmd_run.run_job(argv, prog=prog)
    finally:
        if watch is not None:
            # the agent ended (with c10d, the store's host is the batch host: a spare waiting
            # for it ends with 0): is the batch shell still there to end the job? Its beacon
            # moves within a second if it is.
            watch.settle(watch.dead_after_s + 2)
    exit_now(code)  # as `trainguard run` leaves: without the interpreter's teardown


def _watch_batch_host(env: dict[str, str], node: str, prog: str) -> BatchBeaconWatch | None:
    """On a node other than the batch host: watch the batch beacon; when it stands still, take
    over what the batch script would do (resubmit without the batch host, cancel this job)."""
    from trainguard.slurm.batch import BATCH_HOST_ENV, BEACON_ENV, CONFIG_ENV

    beacon, host, run_dir = env.get(BEACON_ENV), env.get(BATCH_HOST_ENV), envvars.run_dir(env)
    if not beacon or not host or not run_dir or host == node:
        return None
    run_dir, beacon = os.path.abspath(run_dir), os.path.abspath(beacon)
    try:
        cfg = load_config(env.get(CONFIG_ENV)).slurm
    except ConfigError as e:
        print(f"{prog}: batch host not watched: {e}", file=sys.stderr, flush=True)
        return None
    from trainguard.slurm.batchhost import BatchBeaconWatch
    from trainguard.slurm.cli import make_slurm
    from trainguard.slurm.fencer import SlurmFencer
    from trainguard.slurm.finish import take_over

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def on_lost(silent: float) -> None:
        say(f"{prog}: batch host {host} silent for {silent:.1f} s: taking over")
        slurm = make_slurm()
        take_over(
            batch_host=host,
            run_dir=run_dir,
            script=os.path.join(run_dir, "job.sbatch"),
            cfg=cfg,
            slurm=slurm,
            fencer=SlurmFencer(slurm, record_only=cfg.drain == "record"),
            env=env,
            say=say,
        )

    watch = BatchBeaconWatch(beacon, cfg.batch_dead_after_s, on_lost)
    watch.start()
    return watch


def _roles(argv: list[str], prog: str) -> int:
    node = os.environ.get("SLURMD_NODENAME")
    if not node or not os.environ.get("SLURM_JOB_ID"):
        print(
            f"{prog}: error: runs inside a trainguard sbatch job step (srun): SLURM_JOB_ID/"
            "SLURMD_NODENAME are not set",
            file=sys.stderr,
        )
        return 2
    from trainguard.runtime.launcher import UsageError, build_parser, load_tg_config

    args = build_parser(prog).parse_args(argv)
    try:
        cfg = load_tg_config(args)
    except (UsageError, ConfigError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if not args.tg_run_dir:
        print(f"{prog}: error: --tg-run-dir is required (the job's run directory)", file=sys.stderr)
        return 2
    from pathlib import Path

    from trainguard.roles.node import run_role_node

    return run_role_node(cfg.roles, Path(args.tg_run_dir), node)


def _finish(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--since", type=float, required=True)
    p.add_argument("--script", required=True)
    p.add_argument("--config", default=None)
    args = p.parse_args(argv)
    from trainguard.slurm.cli import make_slurm
    from trainguard.slurm.fencer import SlurmFencer
    from trainguard.slurm.finish import finish

    try:
        cfg = load_config(args.config).slurm
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    slurm = make_slurm()
    fencer = SlurmFencer(slurm, record_only=cfg.drain == "record")
    return finish(
        rc=args.rc,
        since=args.since,
        run_dir=args.run_dir,
        script=args.script,
        cfg=cfg,
        slurm=slurm,
        fencer=fencer,
        say=lambda s: print(s, file=sys.stderr, flush=True),
    )


def _status(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description="a trainguard Slurm job's state")
    p.add_argument("job_id")
    p.add_argument("--run-dir", default=None, help="the job's run directory (default: found)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--config", default=None)
    args = p.parse_args(argv)
    from trainguard.slurm.cli import SlurmError, make_slurm
    from trainguard.slurm.status import collect

    try:
        cfg = load_config(args.config).slurm
        st = collect(args.job_id, make_slurm(), run_dir=args.run_dir, runs_root=cfg.runs_root)
    except (ConfigError, SlurmError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if st.state == "UNKNOWN" and st.run_dir is None:
        print(
            f"{prog}: error: Slurm does not know job {args.job_id} and no run directory was "
            "found: pass --run-dir",
            file=sys.stderr,
        )
        return 2
    if args.json:
        print(json.dumps(st.to_dict(), indent=2))
    else:
        print("\n".join(st.lines()))
    return 0


_SUB = {"agent": _agent, "roles": _roles, "finish": _finish, "status": _status}


def main(argv: list[str], *, prog: str = "trainguard slurm") -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    sub = _SUB.get(argv[0])
    if sub is None:
        print(
            f"{prog}: error: unknown subcommand {argv[0]!r}: use {', '.join(_SUB)}",
            file=sys.stderr,
        )
        return 2
    return sub(argv[1:], f"{prog} {argv[0]}")
