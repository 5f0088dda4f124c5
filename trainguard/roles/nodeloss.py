"""Role nodes that fail alone: the loss of a role node takes only its replicas.

Under ``trainguard sbatch`` a role with ``nodes = K`` runs on K nodes of its own, and with
``spares = S`` on S more that wait (:func:`trainguard.core.config.roles.role_node_sets`). Every
role node's agent advances a counter in ``RUN_DIR/role-nodes/<node>.alive`` every second
(:class:`NodeBeacon`). The trainer's agents read the beacons (:class:`RoleNodeWatch`), each on
its own clock; a beacon that stood still for ``[roles] node_dead_after_s`` is a lost node (its
agent killed, the node crashed or cut off). One agent acts (it creates ``<node>.lost``
exclusively), and:

- the lost node is drained in Slurm with the cause (the job's node fencer);
- its replicas' state files say ``failed`` (the fleet endpoint and the rollout clients stop
  routing to them at once);
- a live spare node of the role gets them (``<spare>.assign.json``: the role, the replicas,
  the node it replaces): its agent starts them there, on their ports, and publishes them in
  their state files with its own address (the clients and the endpoint follow);
- with no spare left, the replicas are lost; the role keeps going while its replicas left
  (neither lost nor retired) are at least its ``floor``, else the line naming the role, the
  floor and what was lost goes to ``RUN_DIR/role-nodes/below-floor`` and every trainer agent
  ends the job with it, exit code 96
  (:data:`~trainguard.core.failures.ROLE_BELOW_FLOOR_EXIT_CODE`).

The trainer never restarts for any of it. Who holds which replicas is derived from the files
alone (the initial placement, then every assignment in order), so every trainer agent sees the
same. A node declared lost whose agent still runs (it was frozen) sees its ``.lost`` file and
stops its replicas: the spare runs them now.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainguard.core.atomicfile import write_atomic
from trainguard.core.config.roles import RolesConfig, RoleSpec
from trainguard.core.contracts.engine import ReplicaStatus
from trainguard.core.contracts.event_kinds import ROLE_NODE_LOST
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import EventLog
from trainguard.core.fencing import NodeFencer
from trainguard.roles.placement import place_roles, role_node_sets

__all__ = ["NodeBeacon", "RoleNodeWatch", "assignment", "declared_lost"]

logger = logging.getLogger(__name__)


def _assign_path(rundir: RunDir, node: str) -> Path:
    return rundir.role_nodes / f"{node}.assign.json"


@dataclass(frozen=True)
class Assignment:
    """The replicas a spare node was given: of ``role``, in place of the lost node ``replaces``,
    at ``at`` (wall clock)."""

    role: str
    replicas: list[int]
    replaces: str
    at: float


def assignment(run_dir: Path, node: str) -> Assignment | None:
    """The replicas a spare node was given, or None (none, or a file that is not one)."""
    try:
        got = json.loads(_assign_path(RunDir(run_dir), node).read_text(encoding="utf-8"))
        return Assignment(
            role=str(got["role"]),
            replicas=[int(i) for i in got["replicas"]],
            replaces=str(got["replaces"]),
            at=float(got.get("at", 0.0)),
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def declared_lost(run_dir: Path, node: str) -> bool:
    return (RunDir(run_dir).role_nodes / f"{node}.lost").exists()


class NodeBeacon:
    """A role node's agent: advances ``role-nodes/<node>.alive`` every ``period_s``."""

    def __init__(self, run_dir: Path, node: str, period_s: float = 1.0) -> None:
        self.path = RunDir(run_dir).role_nodes / f"{node}.alive"
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="tg-role-beacon", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while True:
            n += 1
            try:
                write_atomic(self.path, f"{n}\n")
            except OSError as e:  # a full or lost file system: the node looks lost, rightly
                logger.warning("cannot write %s: %s", self.path, e)
            if self._stop.wait(self.period_s):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class RoleNodeWatch:
    """The trainer's agents' watch over the role nodes (see the module docstring).
    ``failure``: the below-floor line once a role fell below its floor (None while not)."""

    def __init__(
        self,
        cfg: RolesConfig,
        run_dir: Path,
        nodes: list[tuple[str, str]],
        events: EventLog,
        fencer: NodeFencer | None,
        *,
        job_id: str = "",
        poll_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.rundir = RunDir(run_dir)
        self.events = events
        self.fencer = fencer
        self.job_id = job_id
        self.poll_s = poll_s
        self.clock = clock
        self.dead_after_s = cfg.node_dead_after_s
        self.specs = {s.name: s for s in cfg.specs() if s.nodes}
        specs = list(self.specs.values())
        self.initial: dict[str, tuple[str, list[int]]] = {}
        """Node → (its role, the replicas placed on it at the start)."""
        for role, placed in place_roles(specs, nodes).items():
            for p in placed:
                self.initial.setdefault(p.node, (role, []))[1].append(p.index)
        self.sets = {
            role: ([n for n, _ in own], [n for n, _ in spare])
            for role, (own, spare) in role_node_sets(specs, nodes).items()
        }
        self.failure: str | None = None
        self._seen: dict[str, tuple[str, float]] = {}
        """Node → (its beacon's last value, when it changed, on this clock)."""
        self._last_poll: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the files say --------------------------------------------------------------------
    def holders(self) -> dict[str, tuple[str, list[int]]]:
        """Node → (role, the replicas it runs now): the initial placement, then every spare's
        assignment in the order it was made."""
        out = {n: (r, list(i)) for n, (r, i) in self.initial.items()}
        given = []
        for path in self.rundir.role_nodes.glob("*.assign.json"):
            node = path.name[: -len(".assign.json")]
            got = assignment(self.rundir.root, node)
            if got:
                given.append((got.at, node, got))
        for _, node, got in sorted(given, key=lambda g: (g[0], g[1])):
            out.pop(got.replaces, None)
            out[node] = (got.role, list(got.replicas))
        return out

    def lost(self) -> set[str]:
        return {p.name[: -len(".lost")] for p in self.rundir.role_nodes.glob("*.lost")}

    # -- the beacons -------------------------------------------------------------------------
    def _silence(self) -> dict[str, float]:
        """One read of every role node's beacon: node → how long it stood still (never-seen
        beacons are not judged)."""
        now = self.clock()
        if self._last_poll is not None and now - self._last_poll > self.dead_after_s / 2:
            # this process could not look for a while (starved): silence across it proves nothing
            self._seen = {n: (v, now) for n, (v, _) in self._seen.items()}
        self._last_poll = now
        out = {}
        for role in self.sets.values():
            for node in (*role[0], *role[1]):
                try:
                    value = (self.rundir.role_nodes / f"{node}.alive").read_text().strip()
                except OSError:
                    value = ""
                seen = self._seen.get(node)
                if value and (seen is None or seen[0] != value):
                    self._seen[node] = (value, now)
                elif seen is not None:
                    out[node] = now - seen[1]
        return out

    def poll(self) -> None:
        """One look: a newly lost node is handled; the below-floor line is picked up."""
        if self.failure is None:
            try:
                self.failure = self.rundir.role_below_floor.read_text(encoding="utf-8").strip()
            except OSError:
                pass
            if self.failure == "":
                self.failure = None
        silence = self._silence()
        lost = self.lost()
        for node, silent in sorted(silence.items()):
            if silent >= self.dead_after_s and node not in lost:
                self._claim(node, silent)

    def _claim(self, node: str, silent: float) -> None:
        path = self.rundir.role_nodes / f"{node}.lost"
        cause = (
            f"role node agent lost in job {self.job_id or '?'} (no beacon for {silent:.0f} s: "
            "agent killed, node failed or unreachable)"
        )
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return  # another trainer agent acts
        except OSError as e:
            logger.warning("cannot claim the loss of role node %s: %s", node, e)
            return
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(cause + "\n")
        try:
            self._lost(node, cause)
        except Exception:  # never into the agent's monitor loop
            logger.exception("handling the loss of role node %s failed", node)

    def _lost(self, node: str, cause: str) -> None:
        held = self.holders().get(node)
        role = held[0] if held else next((r for r, s in self.sets.items() if node in s[1]), "")
        replicas = held[1] if held else []
        drained = self.fencer.fence(node, cause) if self.fencer is not None else None
        spare = None
        if replicas:
            self._mark_failed(role, replicas, f"its node {node} was lost")
            spare = self._pick_spare(role)
            if spare is not None:
                write_atomic(
                    _assign_path(self.rundir, spare),
                    json.dumps(
                        {"role": role, "replicas": replicas, "replaces": node, "at": time.time()}
                    )
                    + "\n",
                )
        spec = self.specs.get(role)
        left = self._left(spec) if spec else None
        self.events.emit(
            ROLE_NODE_LOST,
            node_name=node,
            role=role,
            replicas=replicas,
            spare=spare,
            cause=cause,
            drained=drained.fenced if drained else False,
            drain=drained.detail if drained else "no fencer",
            left=left,
            floor=spec.floor if spec else None,
        )
        if not replicas:
            what = "it ran no replica"
        elif spare:
            what = f"replicas {replicas} of {role} re-placed on {spare}"
        else:
            what = f"replicas {replicas} of {role} lost: no spare node left"
        logger.warning("trainguard: role node %s lost (%s); %s", node, cause, what)
        if spec is not None and left is not None and left < spec.floor:
            line = (
                f"role {role} below its floor of {spec.floor}: {left} of {spec.replicas} "
                f"replicas left; lost node {node} with replicas "
                f"{','.join(map(str, replicas)) or 'none'} and no spare node left for them"
            )
            try:
                write_atomic(self.rundir.role_below_floor, line + "\n")
            except OSError as e:
                logger.warning("cannot write %s: %s", self.rundir.role_below_floor, e)
            self.failure = line

    def _pick_spare(self, role: str) -> str | None:
        holders, lost = self.holders(), self.lost()
        silence = self._silence()
        for node in self.sets.get(role, ([], []))[1]:
            if node in lost or node in holders:
                continue
            if node in self._seen and silence.get(node, 0.0) < self.dead_after_s:
                return node  # its agent waits and beats
        return None

    def _left(self, spec: RoleSpec) -> int:
        """The role's replicas neither lost (on a lost node, with no spare) nor retired."""
        lost = self.lost()
        held = {
            i for node, (r, idx) in self.holders().items() if r == spec.name and node not in lost
            for i in idx
        }  # fmt: skip
        states = {
            s["replica"]: s.get("state") for s in self.rundir.role_states().get(spec.name, [])
        }
        return sum(1 for i in held if states.get(i) != ReplicaStatus.RETIRED)

    def _mark_failed(self, role: str, replicas: list[int], reason: str) -> None:
        for i in replicas:
            path = self.rundir.role_state(role, i)
            try:
                state = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(state, dict) and state.get("state") != ReplicaStatus.RETIRED:
                state.update(
                    state=ReplicaStatus.FAILED.value, reason=reason, changed_at=time.time()
                )
                try:
                    write_atomic(path, json.dumps(state, indent=1) + "\n")
                except OSError as e:
                    logger.warning("cannot write %s: %s", path, e)

    # -- the thread --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the watch's thread (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="tg-role-nodes", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # never into the agent
                logger.exception("the role node watch failed a round")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
