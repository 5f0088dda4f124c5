"""``trainguard sbatch``: write and submit the Slurm batch script of a trainguard job.

    trainguard sbatch --nodes N --spares K [--gpus-per-node G] [--time T] [--partition P]
        [--account A] [--job-name NAME] [--sbatch-arg --name=value ...] [--config TOML]
        [--dry-run] [trainguard run options] script.py [script args]

N nodes train, K more wait as hot spares. Roles (``--tg-role rollout=2:COMMAND``, or
``[roles.*]`` in the config file) are started by every node's agent beside its workers; a role
with ``nodes = R`` (``--tg-role rollout=2,nodes=1,port=8100:COMMAND``) runs on R nodes of its
own, allocated besides (N + K + R nodes in all). ``--dry-run`` prints the script; otherwise it is
checked (``sinfo``, ``sbatch --test-only``), submitted with ``sbatch --parsable`` and the job id
printed. The [slurm] section of the config file sets the preemption grace time, resubmissions,
blocklist, drain mode and rendezvous (see trainguard/core/config/slurm.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, NoReturn

from trainguard.core.config import ConfigError, load_config

if TYPE_CHECKING:
    from trainguard.slurm.batch import BatchRequest
    from trainguard.slurm.cli import SlurmCli

__all__ = ["main"]

# trainguard run options the batch script sets itself.
_RESERVED = {
    "--nnodes": "--nodes/--spares",
    "--rdzv-backend": "[slurm] rdzv_backend",
    "--rdzv_backend": "[slurm] rdzv_backend",
    "--rdzv-endpoint": "[slurm] rdzv_port / etcd_endpoint",
    "--rdzv_endpoint": "[slurm] rdzv_port / etcd_endpoint",
    "--rdzv-id": "the job id",
    "--rdzv_id": "the job id",
    "--rdzv-conf": "[slurm] join_timeout_s",
    "--rdzv_conf": "[slurm] join_timeout_s",
    "--standalone": "--nodes",
    "--tg-run-dir": "[slurm] runs_root",
    "--node-rank": "the rendezvous",
    "--node_rank": "the rendezvous",
    "--master-addr": "the rendezvous",
    "--master_addr": "the rendezvous",
    "--master-port": "the rendezvous",
    "--master_port": "the rendezvous",
}


C10D_NOTE = (
    "trainguard sbatch: note: the rendezvous store runs in the agent on the job's first node "
    "(c10d), a single point of failure: if that agent is lost, no spare can take over and the "
    "job restarts from its newest checkpoint; set [slurm] etcd_endpoint to use the cluster's etcd"
)


class _BadInput(Exception):
    pass


def _own_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], add_help=False)
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("--nodes", type=int, default=None, help="nodes that train")
    p.add_argument("--spares", type=int, default=0, help="extra nodes kept as hot spares")
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--time", default=None, help="time limit (Slurm format, e.g. 2:00:00)")
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--job-name", default=None)
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="--NAME=VALUE")
    p.add_argument("--config", default=None, help="trainguard.toml (its [slurm] section)")
    p.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    return p


def _split(
    argv: list[str], own: argparse.ArgumentParser, run: argparse.ArgumentParser
) -> tuple[list[str], list[str], str | None, list[str]]:
    """(own options, trainguard run options, script, script args)."""
    own_opts: list[str] = []
    run_opts: list[str] = []
    own_actions = own._option_string_actions
    run_actions = run._option_string_actions
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            i += 1
            break
        if not tok.startswith("-") or tok == "-":
            break
        name = tok.split("=", 1)[0]
        if name in own_actions:
            target = own_opts
            action = own_actions[name]
        elif name in run_actions:
            if name in _RESERVED:
                raise _BadInput(f"{name} is set by trainguard sbatch (from {_RESERVED[name]})")
            target = run_opts
            action = run_actions[name]
        else:
            raise _BadInput(f"unknown option {tok!r}: see 'trainguard sbatch --help'")
        if action.nargs != 0 and "=" not in tok:
            if i + 1 >= len(argv):
                raise _BadInput(f"option {name} needs a value")
            i += 1
            # NAME=VALUE, so that a value such as --sbatch-arg's "--mem=4G" is not an option
            tok = f"{tok}={argv[i]}" if target is own_opts else tok
            if target is run_opts:
                target.append(tok)
                tok = argv[i]
        target.append(tok)
        i += 1
    if i >= len(argv):
        return own_opts, run_opts, None, []
    return own_opts, run_opts, argv[i], argv[i + 1 :]


def _check_run_options(
    run: argparse.ArgumentParser, run_opts: list[str], script: str, config: str | None
) -> tuple[int, int]:
    """Check the ``trainguard run`` options (role specs too: here, not on the nodes after the
    job waited in the queue; a fixed fleet endpoint port already taken); the nodes the roles
    need of their own, and how many of them are spares."""

    def error(message: str) -> NoReturn:
        raise _BadInput(f"trainguard run option: {message}")

    # argparse has no hook for its error exit but this method: replaced on this parser only
    run.error = error  # type: ignore[method-assign]
    parsed = run.parse_args([*run_opts, script])
    from trainguard.runtime.launcher import UsageError, role_overrides

    overrides: dict[str, object] = {}
    try:
        if getattr(parsed, "tg_roles", None):
            role_overrides(parsed.tg_roles)  # a malformed flag: its own line first
            overrides = role_overrides(parsed.tg_roles, load_config(config))
    except UsageError as e:
        raise _BadInput(str(e)) from None
    roles = load_config(config, overrides=overrides).roles
    from trainguard.roles.router import check_router_port

    taken = check_router_port(roles)
    if taken:
        raise _BadInput(taken)
    return roles.node_count(), roles.spare_count()


def _check_slurm(req: BatchRequest, slurm: SlurmCli) -> None:
    from trainguard.slurm.cli import SlurmError

    try:
        raw = slurm.partitions()
    except SlurmError as e:
        raise _BadInput(f"cannot reach Slurm ({e}): is this a Slurm login node?") from None
    parts = {p.rstrip("*"): n for p, n in raw.items()}
    if req.partition and req.partition not in parts:
        raise _BadInput(
            f"unknown partition {req.partition!r}: this cluster has "
            f"{', '.join(sorted(parts)) or 'none'}; fix --partition"
        )
    name = req.partition or next((p.rstrip("*") for p in raw if p.endswith("*")), None)
    have = parts.get(name, 0) if name else max(parts.values(), default=0)
    if req.total_nodes > have:
        own = req.role_nodes - req.role_spares
        roles = f" + {own} role node(s)" if own else ""
        roles += f" + {req.role_spares} role spare(s)" if req.role_spares else ""
        raise _BadInput(
            f"--nodes {req.nodes} + --spares {req.spares}{roles} = {req.total_nodes} nodes, but "
            f"partition {name or '?'} has {have}: ask for fewer nodes, spares, role nodes or role spares"
        )
    try:
        slurm.submit(req.materialize(), test_only=True)
    except SlurmError as e:
        raise _BadInput(f"Slurm would not run this job: {e}") from None


def main(argv: list[str], *, prog: str = "trainguard sbatch") -> int:
    from trainguard.runtime.launcher import build_parser
    from trainguard.slurm.batch import BatchRequest
    from trainguard.slurm.cli import SlurmError, make_slurm

    own = _own_parser(prog)
    try:
        own_opts, run_opts, script, script_args = _split(argv, own, build_parser())
        args = own.parse_args(own_opts)
        if args.help:
            print(__doc__)
            return 0
        if args.nodes is None:
            raise _BadInput("--nodes N is required (the nodes that train)")
        if script is None:
            raise _BadInput("no training script given: trainguard sbatch --nodes N script.py")
        if not os.path.isfile(script):
            raise _BadInput(
                f"training script {script!r} not found (working directory {os.getcwd()}): "
                "check the path"
            )
        role_nodes, role_spares = _check_run_options(build_parser(), run_opts, script, args.config)
        cfg = load_config(args.config)
        req = BatchRequest(
            script=script,
            script_args=list(script_args),
            nodes=args.nodes,
            spares=args.spares,
            gpus_per_node=args.gpus_per_node,
            time=args.time,
            partition=args.partition,
            account=args.account,
            job_name=args.job_name,
            sbatch_args=list(args.sbatch_arg),
            run_args=run_opts,
            config_file=os.path.abspath(args.config) if args.config else None,
            slurm=cfg.slurm,
            dir_mode=cfg.runtime.dir_mode,
            python=cfg.slurm.python or sys.executable,
            role_nodes=role_nodes,
            role_spares=role_spares,
        )
        if args.dry_run:
            print(req.materialize(), end="")
            return 0
        slurm = make_slurm()
        _check_slurm(req, slurm)
        os.makedirs(cfg.slurm.runs_root, exist_ok=True)
        job_id = slurm.submit(req.materialize())
        if cfg.slurm.rendezvous == "c10d":
            print(C10D_NOTE, file=sys.stderr)
    except (_BadInput, ConfigError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except SlurmError as e:
        print(f"{prog}: error: sbatch failed: {e}", file=sys.stderr)
        return 1
    print(job_id)
    return 0
