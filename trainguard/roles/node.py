"""A role node of a ``trainguard sbatch`` job: the agent of a node that runs only role replicas.

A role with ``nodes = K`` runs on K nodes of its own (the batch script allocates them besides
the trainer's and starts this agent there, one per node, in a step of its own). Every node
derives the same placement from ``TRAINGUARD_SBATCH_ROLE_NODES``
(:func:`trainguard.roles.placement.place_roles`): the trainer's agents give their workers the
URLs, this agent starts and supervises the replicas placed on its node with the same
:class:`RoleSupervisor` as beside a trainer (own restart budget, own events, warm standbys).
It takes no part in the trainer's rendezvous: an engine's death, or this agent's, never
restarts a trainer rank.

It ends when the trainer is done (the batch script creates ``TRAINGUARD_SBATCH_ROLES_STOP``)
or on SIGTERM/SIGINT (exit 0), stopping its replicas by PID. A role failure (budget spent,
never ready) is written, one line, to ``TRAINGUARD_SBATCH_ROLES_FAILED``: the trainer's agents
read it and end the job with it (exit 2), as a role failure beside the trainer does.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from trainguard.core.atomicfile import write_atomic
from trainguard.core.config.roles import RolesConfig
from trainguard.core.contracts import envvars
from trainguard.core.events import EventLog
from trainguard.roles.placement import place_roles
from trainguard.roles.supervisor import RoleSupervisor

__all__ = ["run_role_node"]

_POLL_S = 0.25


def run_role_node(
    cfg: RolesConfig,
    run_dir: Path,
    node: str,
    *,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run this node's replicas until the trainer is done; the exit code (0, or 2 for a role
    failure or a node that is not a role node of the job)."""
    env = dict(os.environ if env is None else env)

    def line(text: str) -> None:
        print(f"trainguard roles: {text}", file=sys.stderr, flush=True)

    nodes = envvars.parse_role_nodes(env.get(envvars.SBATCH_ROLE_NODES, ""))
    specs = [s for s in cfg.specs() if s.nodes]
    try:
        placement = place_roles(specs, nodes)
    except ValueError as e:
        line(f"error: {e}")
        return 2
    addr = dict(nodes).get(node)
    indices = {
        role: [p.index for p in placed if p.node == node] for role, placed in placement.items()
    }
    mine = [s for s in specs if indices.get(s.name)]
    if addr is None or not mine:
        line(f"error: node {node} runs no replica of the roles placed on {nodes}")
        return 2
    stop_file = env.get(envvars.SBATCH_ROLES_STOP)
    failed_file = env.get(envvars.SBATCH_ROLES_FAILED)

    def fail(text: str) -> int:
        line(text)
        if failed_file and not os.path.exists(failed_file):
            try:
                write_atomic(Path(failed_file), f"{text} (on node {node})\n")
            except OSError as e:
                line(f"cannot write {failed_file}: {e}")
        return 2

    for spec in mine:
        exe = spec.command[0]
        if not (shutil.which(exe, path=env.get("PATH")) or (os.sep in exe and os.path.isfile(exe))):
            return fail(
                f"role {spec.name}: command {exe!r} not found (working directory "
                f"{os.getcwd()}): check the path or PATH of --tg-role / [roles.{spec.name}]"
            )
    try:
        sup = RoleSupervisor(
            cfg, run_dir, EventLog(run_dir, node=node), env=env, specs=mine, indices=indices,
            host=addr,
        )  # fmt: skip
    except ValueError as e:  # the fleet's secret file is unsafe
        return fail(f"error: {e}")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        # Slurm's preemption notice goes to every process of the job's steps: the trainer's
        # workers save; the replicas here (which inherit the ignored signals) have nothing to
        # save and end with the job
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    placed = ", ".join(f"{s.name} {','.join(str(i) for i in indices[s.name])}" for s in mine)
    line(f"node {node} ({addr}): replicas {placed}")
    sup.start()
    code = 0
    try:
        while not stop.wait(_POLL_S):
            if sup.failure is not None:
                code = fail(sup.failure)
                break
            if stop_file and os.path.exists(stop_file):
                break
    finally:
        sup.stop()
    return code
