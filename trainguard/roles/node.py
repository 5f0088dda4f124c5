"""A role node of a ``trainguard sbatch`` job: the agent of a node that runs only role replicas.

A role with ``nodes = K`` runs on K nodes of its own (the batch script allocates them besides
the trainer's and starts this agent there, one per node, in a step of its own). Every node
derives the same placement from ``TRAINGUARD_SBATCH_ROLE_NODES``
(:func:`trainguard.roles.placement.place_roles`): the trainer's agents give their workers the
URLs, this agent starts and supervises the replicas placed on its node with the same
:class:`RoleSupervisor` as beside a trainer (own restart budget, own events, warm standbys).
It takes no part in the trainer's rendezvous: an engine's death, or this agent's, never
restarts a trainer rank.

A role's spare nodes (``spares = S``) run this agent too, with no replica: it waits until the
trainer's agents give it the replicas of a lost node (:mod:`trainguard.roles.nodeloss`), then
starts them here. Every role node's agent advances its beacon (``RUN_DIR/role-nodes/
<node>.alive``) while it runs; an agent whose node was declared lost (it was frozen past
``[roles] node_dead_after_s``) stops its replicas and exits: a spare runs them now.

It ends when the trainer is done (the batch script creates ``TRAINGUARD_SBATCH_ROLES_STOP``)
or on SIGTERM/SIGINT (exit 0), stopping its replicas by PID. A role failure (budget spent,
never ready) is written, one line, to ``TRAINGUARD_SBATCH_ROLES_FAILED``: the trainer's agents
read it and end the job with it (exit 2), as a role failure beside the trainer does; a role
below its floor (replicas retired) goes to ``RUN_DIR/role-nodes/below-floor`` (exit 96).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType

from trainguard.core.atomicfile import write_atomic
from trainguard.core.config.roles import RolesConfig, RoleSpec
from trainguard.core.contracts import envvars
from trainguard.core.contracts.event_kinds import ROLE_NODE_REPLACED
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import EventLog
from trainguard.core.failures import ROLE_BELOW_FLOOR_EXIT_CODE
from trainguard.roles.nodeloss import NodeBeacon, assignment, declared_lost
from trainguard.roles.placement import place_roles, role_node_sets
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
    """Run this node's replicas (a spare: those it is given) until the trainer is done; the
    exit code (0; 2 for a role failure or a node that is not a role node of the job; 96 for a
    role below its floor)."""
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
    spare_of = [s for s in specs if node in (n for n, _ in role_node_sets(specs, nodes)[s.name][1])]
    if addr is None or not (mine or spare_of):
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

    for spec in mine or spare_of:
        exe = spec.command[0]
        if not (shutil.which(exe, path=env.get("PATH")) or (os.sep in exe and os.path.isfile(exe))):
            return fail(
                f"role {spec.name}: command {exe!r} not found (working directory "
                f"{os.getcwd()}): check the path or PATH of --tg-role / [roles.{spec.name}]"
            )
    events = EventLog(run_dir, node=node)
    sup: RoleSupervisor | None = None
    if mine:
        try:
            sup = RoleSupervisor(
                cfg, run_dir, events, env=env, specs=mine, indices=indices, host=addr,
            )  # fmt: skip
        except ValueError as e:  # the fleet's secret file is unsafe
            return fail(f"error: {e}")
    stop = _stop_on_signals()
    if mine:
        placed = ", ".join(f"{s.name} {','.join(map(str, indices[s.name]))}" for s in mine)
        line(f"node {node} ({addr}): replicas {placed}")
    else:
        line(f"node {node} ({addr}): spare of role {spare_of[0].name}, waiting")
    beacon = NodeBeacon(run_dir, node)
    beacon.start()
    try:
        return _supervise(
            sup,
            stop,
            fail,
            lambda: _take_over(cfg, run_dir, node, addr, spare_of, env, events),
            run_dir,
            node,
            stop_file,
            line,
        )
    finally:
        beacon.stop()


def _supervise(
    sup: RoleSupervisor | None,
    stop: threading.Event,
    fail: Callable[[str], int],
    take_over: Callable[[], RoleSupervisor | None],
    run_dir: Path,
    node: str,
    stop_file: str | None,
    line: Callable[[str], None],
) -> int:
    """The agent's loop: until the trainer is done, a role failure, or this node declared
    lost; ``take_over`` (a spare's): the supervisor of the replicas it was given, once."""
    code = 0
    if sup is not None:
        sup.start()
    try:
        while not stop.wait(_POLL_S):
            if sup is None and (sup := take_over()) is not None:
                sup.start()
            if sup is not None and sup.failure is not None:
                if sup.below_floor:
                    code = _below_floor(run_dir, f"{sup.failure} (on node {node})", line)
                else:
                    code = fail(sup.failure)
                break
            if stop_file and os.path.exists(stop_file):
                break
            if declared_lost(run_dir, node):
                line(f"node {node} was declared lost (its beacon stood still): stopping")
                break
    finally:
        if sup is not None:
            sup.stop()
    return code


def _stop_on_signals() -> threading.Event:
    """An event set by SIGTERM/SIGINT (in the main thread)."""
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
    return stop


def _below_floor(run_dir: Path, text: str, line: Callable[[str], None]) -> int:
    line(text)
    path = RunDir(run_dir).role_below_floor
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            write_atomic(path, text + "\n")
    except OSError as e:
        line(f"cannot write {path}: {e}")
    return ROLE_BELOW_FLOOR_EXIT_CODE


def _take_over(
    cfg: RolesConfig,
    run_dir: Path,
    node: str,
    addr: str,
    spare_of: list[RoleSpec],
    env: dict[str, str],
    events: EventLog,
) -> RoleSupervisor | None:
    """A spare node given a lost node's replicas: the supervisor that runs them here."""
    got = assignment(run_dir, node)
    if got is None:
        return None
    spec = next((s for s in spare_of if s.name == got.role), None)
    if spec is None:
        return None
    replicas = got.replicas
    print(
        f"trainguard roles: node {node} ({addr}): runs replicas {','.join(map(str, replicas))} "
        f"of role {spec.name} of the lost node {got.replaces}",
        file=sys.stderr,
        flush=True,
    )
    events.emit(
        ROLE_NODE_REPLACED, role=spec.name, replicas=replicas, replaces=got.replaces,
        addr=addr,
    )  # fmt: skip
    return RoleSupervisor(
        cfg, run_dir, events, env=env, specs=[spec], indices={spec.name: replicas}, host=addr
    )
