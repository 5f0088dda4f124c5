"""The role supervisor: a job's engine fleets (``rollout``, ``reward``) beside its trainer.

Each replica is an independent process (its own session: its process group is its PID) that
the supervisor starts, probes and restarts on its own, from one thread per replica
(:class:`~trainguard.roles.replica.ReplicaLoop`, whose docstring is the replica's state
machine). A role with ``standby = K`` also keeps a pool of K warm standbys
(:class:`~trainguard.roles.standby.StandbyPool`): a replica that dies takes a ready one (the
same refit-gated rejoin as a restart, without the start-up) and a new one starts behind it.

Every process is started with an incarnation nonce (``TRAINGUARD_AGENT_ROLE_INCARNATION``) and its
health answers must name it (:mod:`trainguard.roles.health`): an answer from another process on
the port is never counted. Process plumbing is :mod:`trainguard.roles.procs`; liveness apart
from readiness is :mod:`trainguard.roles.liveness`.

The trainer's workers are not the supervisor's business: an engine's death never touches a
rank, and the agent restarting its workers never touches an engine. Every change is an event
(``role_*``) and the replica's state file (``roles/<role>/<i>.json``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from trainguard.core.atomicfile import write_atomic
from trainguard.core.config.roles import RolesConfig, RoleSpec
from trainguard.core.contracts import envvars
from trainguard.core.contracts.engine import ReplicaStatus as S
from trainguard.core.contracts.event_kinds import (
    ROLE_PORT_TAKEN,
    ROLE_REPLICA_FAILED,
    ROLE_REPLICA_RETIRED,
    ROLE_REPLICA_STARTED,
    ROLE_REPLICA_STATE,
    ROLE_RESTART_BUDGET_EXHAUSTED,
    ROLE_STANDBY_STATE,
)
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import EventLog
from trainguard.core.fleetauth import job_secret, role_token
from trainguard.roles.health import Probe, probe_health
from trainguard.roles.procs import free_port, kill_group, reserve_port
from trainguard.roles.replica import READY_STATUSES, ReplicaLoop
from trainguard.roles.standby import StandbyPool
from trainguard.roles.state import ReplicaState, StandbyState

__all__ = [
    "READY_STATUSES",
    "Probe",
    "ReplicaState",
    "RoleSupervisor",
    "StandbyState",
    "probe_health",
]

_TOKEN_VARS = (envvars.ROLE_TOKEN, *envvars.ROLE_TOKENS.values())

logger = logging.getLogger(__name__)


class RoleSupervisor:
    """Starts, probes and restarts the replicas of every declared role (one thread each)."""

    def __init__(
        self,
        cfg: RolesConfig,
        run_dir: Path,
        events: EventLog,
        *,
        env: Mapping[str, str] | None = None,
        specs: list[RoleSpec] | None = None,
        indices: Mapping[str, list[int]] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        """``specs``: the roles this supervisor runs (default: those beside the trainer, without
        ``nodes``); ``indices``: the replicas of each it runs (default: all); ``host``: this
        node's address, the host of the URLs and the default bind of roles on nodes of their
        own (replicas beside the trainer bind and are reached on ``127.0.0.1``)."""
        self.cfg = cfg
        self.specs = [s for s in cfg.specs() if not s.nodes] if specs is None else list(specs)
        self.bind_host: dict[str, str] = {}
        """Role → the address its replicas bind (``TRAINGUARD_AGENT_ROLE_HOST``)."""
        self._probe_host: dict[str, str] = {}
        """Role → the address its health is probed on (``127.0.0.1`` when it binds every one)."""
        for spec in self.specs:
            bind = spec.bind or (host if spec.nodes else "127.0.0.1")
            self.bind_host[spec.name] = bind
            self._probe_host[spec.name] = "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind
        self.rundir = RunDir(run_dir)
        self.events = events
        self._env = dict(os.environ if env is None else env)
        """The environment the replicas start from: the agent's before it prepared its workers'
        (never the workers' hooks or the agent→worker names of :mod:`trainguard.core.contracts.envvars`)."""
        for var in list(self._env):
            if var.startswith(envvars.PREFIX) or var in _TOKEN_VARS:
                del self._env[var]
        secret = job_secret(run_dir)  # ValueError (one line) when the file is unsafe
        self.tokens = {s.name: role_token(secret, s.name) for s in cfg.specs()}
        """Role → its token (each replica gets its own role's only)."""
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.procs: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
        """(role, replica index or ``standby-<k>``) → the process running it."""
        self.replicas: dict[str, list[ReplicaState]] = {}
        self.restarts: dict[str, int] = {}
        self.failure: str | None = None
        """The first role failure (one line), None while every role runs."""
        self.below_floor = False
        """Whether that failure is a role below its ``floor`` (exit code 96, not 2)."""
        self._budget_spent: set[str] = set()
        """Roles whose restart budget was reported spent (``role_restart_budget_exhausted``)."""
        self.startup_s: dict[str, float] = {}
        """Role → its longest start-up measured (a fresh start to its first ready answer)."""
        self.ended = threading.Event()
        """Set by :meth:`stop` once every process is ended: a standby thread waits for it
        before it exits (a promoted replica's death signal is tied to the thread that
        started it)."""
        self.niceness = os.getpriority(os.PRIO_PROCESS, 0)
        self._pools = {s.name: StandbyPool(self, s) for s in self.specs if s.standby}
        self.standbys: dict[str, list[StandbyState]] = {
            s.name: self._pools[s.name].slots if s.name in self._pools else [] for s in self.specs
        }
        self._reserved: list[socket.socket] = []  # picked ports, held until stop (reserve_port)
        for spec in self.specs:
            url_host = host if spec.nodes else "127.0.0.1"
            mine = range(spec.replicas) if indices is None else indices.get(spec.name, [])
            self.replicas[spec.name] = [
                ReplicaState(
                    spec,
                    i,
                    spec.port + i if spec.port else self._reserve(spec),
                    events.node,
                    url_host,
                )
                for i in mine
            ]
            self.restarts[spec.name] = 0
        self.started = False
        self._host = host

    def _reserve(self, spec: RoleSpec) -> int:
        """A port for a replica of ``spec`` without a fixed port, held from now on."""
        sock = reserve_port(self.bind_host[spec.name])
        self._reserved.append(sock)
        return int(sock.getsockname()[1])

    # -- what the trainer is told -------------------------------------------------------------
    def urls(self, role: str) -> list[str]:
        return [r.url for r in self.replicas.get(role, [])]

    def trainer_env(self) -> dict[str, str]:
        """``TRAINGUARD_ROLLOUT_URLS`` / ``TRAINGUARD_REWARD_URLS`` for the trainer's workers."""
        env = {envvars.ROLE_URLS[name]: ",".join(self.urls(name)) for name in self.replicas}
        return {**env, **{envvars.ROLE_TOKENS[name]: tok for name, tok in self.tokens.items()}}

    def pids(self, role: str) -> list[int | None]:
        return [r.pid for r in self.replicas.get(role, [])]

    def serving(self, role: str) -> int:
        return sum(r.state == S.SERVING for r in self.replicas.get(role, []))

    @property
    def pools(self) -> dict[str, StandbyPool]:
        """Role → its warm standbys (roles with ``standby = K``)."""
        return self._pools

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start every replica's and standby's thread (idempotent)."""
        if self.started:
            return
        self.started = True
        for spec in self.specs:
            for rep in self.replicas[spec.name]:
                self._thread(ReplicaLoop(self, spec, rep).run, f"{spec.name}-{rep.index}")
            if (pool := self.pools.get(spec.name)) is None:
                continue
            for sb in pool.slots:
                self._thread(functools.partial(pool.run_slot, sb), f"{spec.name}-sb{sb.slot}")

    def add_replicas(self, spec: RoleSpec, indices: list[int]) -> None:
        """Run replicas ``indices`` of ``spec`` here from now on (a spare role node given a lost
        node's replicas): each takes a ready warm standby of this node for its first start
        when there is one, else starts cold."""
        for i in indices:
            rep = ReplicaState(spec, i, spec.port + i, self.events.node, self._host)
            rep.from_standby = True
            self.replicas[spec.name].append(rep)
            self._thread(ReplicaLoop(self, spec, rep).run, f"{spec.name}-{rep.index}")

    def _thread(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=f"trainguard-role-{name}", daemon=True)
        self._threads.append(t)
        t.start()

    def stop(self) -> None:
        """End every replica: SIGTERM to its process group, SIGKILL after ``stop_timeout_s``."""
        self.stopping.set()
        with self.lock:
            procs = list(self.procs.values())
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.stop_timeout_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if proc.poll() is None:
                kill_group(proc.pid, signal.SIGKILL)
                try:
                    proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    logger.warning("role replica pid %d did not end after SIGKILL", proc.pid)
            else:  # the leader is gone; its group may not be
                kill_group(proc.pid, signal.SIGKILL)
        self.ended.set()
        for sock in self._reserved:
            sock.close()
        for t in self._threads:
            t.join(timeout=5.0)
        for spec in self.specs:
            for rep in self.replicas[spec.name]:
                if rep.state not in (S.FAILED, S.RETIRED, S.STOPPED):
                    self.set_state(rep, S.STOPPED, reason="the job ended")
            for sb in self.standbys.get(spec.name, []):
                if sb.state not in (S.FAILED, S.STOPPED):
                    self.set_standby(sb, S.STOPPED, reason="the job ended")

    # -- what the replicas and standbys share ------------------------------------------------
    def role_env(
        self, spec: RoleSpec, port: int, incarnation: str, *, replica: int | None = None
    ) -> dict[str, str]:
        """The environment of one start of a replica (or, ``replica`` None, a standby)."""
        env = dict(self._env)
        env.update(dict(spec.env))
        env[envvars.ROLE] = spec.name
        if replica is not None:
            env[envvars.ROLE_REPLICA] = str(replica)
        env[envvars.ROLE_PORT] = str(port)
        env[envvars.ROLE_HOST] = self.bind_host[spec.name]
        env[envvars.ROLE_RUN_DIR] = str(self.rundir.root)
        env[envvars.ROLE_TOKEN] = self.tokens[spec.name]
        env[envvars.ROLE_INCARNATION] = incarnation
        return env

    def probe(self, spec: RoleSpec, port: int) -> Probe:
        return probe_health(
            port, spec.health_path, self.cfg.probe_timeout_s, self._probe_host[spec.name],
            token=self.tokens[spec.name], verify_answer=False,
        )  # fmt: skip

    def standby_port(self, spec: RoleSpec) -> int:
        """A free port for one start of a standby, never a replica's (a dead replica's port is
        free until its successor binds it), nor one of a role's fixed ports (a spare role node
        may be given any replica of its role)."""
        bind = self.bind_host[spec.name]
        host = bind if bind and ":" not in bind and bind != "0.0.0.0" else "127.0.0.1"
        taken = {r.port for reps in self.replicas.values() for r in reps}
        for s in self.cfg.specs():
            taken.update(range(s.port, s.port + s.replicas) if s.port else ())
        while (port := free_port(host)) in taken:
            pass
        return port

    def note_startup(self, spec: RoleSpec, seconds: float) -> None:
        with self.lock:
            self.startup_s[spec.name] = max(seconds, self.startup_s.get(spec.name, 0.0))

    def replica_started(
        self, spec: RoleSpec, rep: ReplicaState, pid: int, incarnation: str, standby: int | None
    ) -> None:
        """Replica ``rep`` runs as ``pid`` now (a fresh process or a promoted standby)."""
        rep.pid = pid
        rep.incarnation = incarnation
        rep.exitcode = None
        rep.started_at = time.time()
        rep.ready_at = None
        rep.last_ok = None
        rep.weight_version = None
        rep.reason = ""
        self.events.emit(
            ROLE_REPLICA_STARTED,
            role=spec.name,
            replica=rep.index,
            pid=pid,
            incarnation=incarnation,
            port=rep.port,
            url=rep.url,
            restarts=rep.restarts,
            role_restarts=self.restarts[spec.name],
            command=list(spec.command),
            total=spec.replicas,
            standby=standby,
        )

    def port_taken(
        self, spec: RoleSpec, rep: ReplicaState, pid: int | None, holder: str, waited_s: float
    ) -> None:
        logger.warning(
            "role %s replica %d: port %d is held by another process (%s)",
            spec.name,
            rep.index,
            rep.port,
            holder,
        )
        self.events.emit(
            ROLE_PORT_TAKEN,
            role=spec.name,
            replica=rep.index,
            port=rep.port,
            holder_pid=pid,
            holder=holder,
            waited_s=waited_s,
        )

    def replica_failed(
        self, spec: RoleSpec, rep: ReplicaState, reason: str, was_ready: bool
    ) -> None:
        self.events.emit(
            ROLE_REPLICA_FAILED,
            role=spec.name,
            replica=rep.index,
            pid=rep.pid,
            exitcode=rep.exitcode,
            reason=reason,
            was_ready=was_ready,
            restarts=self.restarts[spec.name],
            restart_budget=spec.restart_budget,
        )

    def allow_restart(
        self, spec: RoleSpec, rep: ReplicaState, reason: str, was_ready: bool
    ) -> bool:
        """Whether a replica that died is restarted (counted against the role's budget); else
        it is retired or the role failed."""
        log = self.rundir.role_log(spec.name, rep.index)
        at_once = "" if was_ready else " before it was ever ready"
        if spec.restart_policy != "always":
            self.fail(
                spec,
                rep,
                f"replica {rep.index} ({' '.join(spec.command)}) {reason}{at_once}; "
                f"restart_policy is never; see {log}",
                budget=True,
            )
            return False
        if spec.retire_after and rep.restarts >= spec.retire_after:
            self.retire(spec, rep, f"{reason}{at_once}, after {rep.restarts} restarts")
            return False
        with self.lock:
            allowed = self.restarts[spec.name] < spec.restart_budget
            if allowed:
                self.restarts[spec.name] += 1
        if not allowed:
            self.fail(
                spec,
                rep,
                f"replica {rep.index} ({' '.join(spec.command)}) {reason}{at_once}; "
                f"restart budget {spec.restart_budget} spent; see {log}",
                budget=True,
            )
        return allowed

    def retire(self, spec: RoleSpec, rep: ReplicaState, reason: str) -> None:
        """Replica ``rep`` is not restarted again; the role goes on while it keeps its floor."""
        self.set_state(rep, S.RETIRED, reason=reason)
        with self.lock:
            left = sum(r.state not in (S.RETIRED, S.FAILED) for r in self.replicas[spec.name])
        self.events.emit(
            ROLE_REPLICA_RETIRED,
            role=spec.name,
            replica=rep.index,
            restarts=rep.restarts,
            reason=reason,
            left=left,
            floor=spec.floor,
        )
        if left < spec.floor:
            with self.lock:
                self.below_floor = self.below_floor or self.failure is None
            self.fail(
                spec,
                rep,
                f"{left} of {len(self.replicas[spec.name])} replicas left, below its floor of "
                f"{spec.floor}: replica {rep.index} ({' '.join(spec.command)}) retired: "
                f"{reason}; see {self.rundir.role_log(spec.name, rep.index)}",
                keep_state=True,
            )

    def set_standby(
        self, sb: StandbyState, state: S, *, reason: str = "", force: bool = False
    ) -> None:
        if state == sb.state and not force:
            return
        previous = sb.state
        sb.state = state
        sb.changed_at = time.time()
        sb.reason = reason
        path = self.rundir.role_standby(sb.role, sb.slot, "json")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(sb.to_json(), indent=1) + "\n")
        except OSError as e:
            logger.warning("cannot write %s: %s", path, e)
        self.events.emit(
            ROLE_STANDBY_STATE,
            role=sb.role,
            slot=sb.slot,
            state=state,
            previous=previous,
            reason=reason,
            pid=sb.pid,
            incarnation=sb.incarnation,
            port=sb.port,
            starts=sb.starts,
        )

    def fail(
        self,
        spec: RoleSpec,
        rep: ReplicaState,
        message: str,
        budget: bool = False,
        keep_state: bool = False,
    ) -> None:
        line = f"role {spec.name} failed: {message}"
        with self.lock:
            if self.failure is None:
                self.failure = line
            # replicas that fail together find the budget spent at once: one event per role
            first_spent = budget and spec.name not in self._budget_spent
            if budget:
                self._budget_spent.add(spec.name)
        if first_spent:
            self.events.emit(
                ROLE_RESTART_BUDGET_EXHAUSTED,
                role=spec.name,
                replica=rep.index,
                restarts=self.restarts[spec.name],
                restart_budget=spec.restart_budget,
                message=line,
            )
        if not keep_state:
            self.set_state(rep, S.FAILED, reason=message)
        logger.debug("%s", line)  # the agent ends the job with this line

    # -- state ----------------------------------------------------------------------------------
    def answered(
        self, spec: RoleSpec, rep: ReplicaState, status: S, version: int | None
    ) -> str | None:
        """Record a health answer's status. A replica newly ``quarantined`` (its weights
        failed a client's refit check; it refits again, serving nothing meanwhile) is
        counted against the role's restart budget: the reason to end it once it is spent."""
        dead = None
        if status is S.QUARANTINED and rep.state != S.QUARANTINED:
            with self.lock:
                spent = self.restarts[spec.name] >= spec.restart_budget
                if not spent:
                    self.restarts[spec.name] += 1
            if spent:
                dead = "quarantined (a failed refit) with the restart budget spent"
        self.set_state(rep, status, weight_version=version)
        return dead

    def set_state(
        self,
        rep: ReplicaState,
        state: S,
        *,
        reason: str = "",
        weight_version: int | None = None,
        force: bool = False,
    ) -> None:
        version_changed = weight_version is not None and weight_version != rep.weight_version
        if state == rep.state and not version_changed and not force:
            return
        previous = rep.state
        if weight_version is not None:
            rep.weight_version = weight_version
        rep.state = state
        rep.changed_at = time.time()
        if reason:
            rep.reason = reason
        self._write(rep)
        self.events.emit(
            ROLE_REPLICA_STATE,
            role=rep.role,
            replica=rep.index,
            state=state,
            previous=previous,
            reason=reason,
            pid=rep.pid,
            weight_version=rep.weight_version,
            serving=self.serving(rep.role),
            total=len(self.replicas[rep.role]),
        )

    def _write(self, rep: ReplicaState) -> None:
        path = self.rundir.role_state(rep.role, rep.index)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(rep.to_json(), indent=1) + "\n")
        except OSError as e:
            logger.warning("cannot write %s: %s", path, e)
