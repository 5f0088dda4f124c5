"""The role supervisor: a job's engine fleets (``rollout``, ``reward``) beside its trainer.

Each replica is an independent process (its own session: its process group is its PID) that
the supervisor starts, probes and restarts on its own, from one thread per replica:

    starting → loading → serving → suspect → dead → restarting → starting ...

- ``starting``: the process runs, its health endpoint has not answered yet (or says so);
- ``loading`` / ``serving``: what ``GET <health_path>`` answers (200, JSON ``status``);
- ``suspect``: a probe failed (timeout, error, HTTP status, malformed JSON) after it answered;
- ``dead``: the process exited, refused a connection after it had answered (at once), or has
  been without a good probe for ``dead_after_s`` (a frozen process: SIGSTOP); the process
  group is killed by PID;
- ``restarting``: counted against the role's restart budget, then started again with the same
  replica index and port (so the trainer's URLs stay valid);
- ``failed``: not restarted (budget spent, policy ``never``, or never ready): the role fails
  and the node agent ends the job with one line naming the replica.

A role with ``standby = N`` also keeps N warm standbys (one thread each): processes started
with the role's command at low CPU priority (``[roles] standby_nice``) and
``TRAINGUARD_ROLE_STANDBY`` set, on a port of their own that no trainer is told of. A standby
that answers its health with ``standby`` is ready. When a replica dies, a ready standby is
promoted in its place (the supervisor writes its promotion file, the standby takes the
replica's port and reports ``loading`` until it holds the current weights: the same
refit-gated rejoin as a restart, without the start-up) and a new standby is started behind
it. Without a ready standby the replica restarts cold, as without the setting.

The trainer's workers are not the supervisor's business: an engine's death never touches a
rank, and the agent restarting its workers never touches an engine. Every change is an event
(``role_replica_*``) and the replica's state file (``roles/<role>/<i>.json``).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainguard.core import envvars
from trainguard.core.atomicfile import open_append, write_atomic
from trainguard.core.config.roles import RolesConfig, RoleSpec
from trainguard.core.engine_contract import (
    READY_STATUSES,
    Probe,
    probe_health,
)
from trainguard.core.engine_contract import ReplicaStatus as S
from trainguard.core.event_kinds import (
    ROLE_REPLICA_FAILED,
    ROLE_REPLICA_STARTED,
    ROLE_REPLICA_STATE,
    ROLE_RESTART_BUDGET_EXHAUSTED,
    ROLE_STANDBY_STATE,
)
from trainguard.core.events import EventLog
from trainguard.core.rundir import RunDir

__all__ = ["Probe", "ReplicaState", "RoleSupervisor", "StandbyState", "probe_health"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_MAX_BACKOFF_S = 5.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _resolve_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _resolve_prctl()
"""Resolved here, in the parent: the child between fork and exec only calls it (a dlopen
there could block on a loader lock another thread held at the fork)."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The replica is SIGKILLed if the thread that started it (the supervisor's, in the
    node agent) goes away: an agent killed -9 leaves no orphan engine holding its port."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _standby_preexec(nice: int) -> Any:
    def preexec() -> None:  # pragma: no cover - runs in the child between fork and exec
        if nice:
            try:
                os.nice(nice)
            except OSError:
                pass
        _die_with_parent()

    return preexec


def _renice(pid: int, niceness: int) -> bool:
    """Every thread of ``pid`` to ``niceness`` (Linux: a priority is per thread); False when
    the OS refuses (lowering it needs root or RLIMIT_NICE)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    ok = True
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError:
            ok = False
    return ok


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except OSError:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


class ReplicaState:
    """What the supervisor knows of one replica (written to its state file)."""

    def __init__(
        self, spec: RoleSpec, index: int, port: int, node: str = "", host: str = "127.0.0.1"
    ) -> None:
        self.node = node
        self.role = spec.name
        self.index = index
        self.port = port
        self.url = spec.url(port, host)
        self.state = S.STARTING
        self.pid: int | None = None
        self.restarts = 0
        self.weight_version: int | None = None
        self.ever_ready = False
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.changed_at = time.time()
        self.last_ok: float | None = None
        self.exitcode: int | None = None
        self.reason = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "replica": self.index,
            "node": self.node,
            "pid": self.pid,
            "port": self.port,
            "url": self.url,
            "state": self.state.value,
            "restarts": self.restarts,
            "weight_version": self.weight_version,
            "started_at": self.started_at,
            "ready_at": self.ready_at,
            "changed_at": self.changed_at,
            "last_ok": self.last_ok,
            "exitcode": self.exitcode,
            "reason": self.reason,
        }


class StandbyState:
    """One warm standby slot of a role (written to ``roles/<role>/standby-<k>.json``)."""

    def __init__(self, spec: RoleSpec, slot: int, port: int) -> None:
        self.role = spec.name
        self.slot = slot
        self.port = port
        self.state = S.STARTING
        self.pid: int | None = None
        self.starts = 0
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.changed_at = time.time()
        self.reason = ""
        self.promoted = False
        """Set (under the supervisor's lock) when a replica took this incarnation."""
        self.handed = threading.Event()
        """Set once the replica that took it has done its bookkeeping (then a new one starts)."""
        self.promote_path: Path | None = None
        """This incarnation's promotion file (one per incarnation: a promoted process may read
        it after the next standby started)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "slot": self.slot,
            "pid": self.pid,
            "port": self.port,
            "state": self.state.value,
            "starts": self.starts,
            "started_at": self.started_at,
            "ready_at": self.ready_at,
            "changed_at": self.changed_at,
            "reason": self.reason,
        }


_STANDBY_GIVE_UP = 3
"""A standby slot that failed this many times in a row before it was ever ready stops: the
role goes on with cold restarts (one ``role_standby_state`` ``failed`` event says why)."""


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
        self._bind: dict[str, str] = {}
        """Role → the address its replicas bind (``TRAINGUARD_ROLE_HOST``)."""
        self._probe_host: dict[str, str] = {}
        """Role → the address its health is probed on (``127.0.0.1`` when it binds every one)."""
        for spec in self.specs:
            bind = spec.bind or (host if spec.nodes else "127.0.0.1")
            self._bind[spec.name] = bind
            self._probe_host[spec.name] = "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind
        self.rundir = RunDir(run_dir)
        self.events = events
        self._env = dict(os.environ if env is None else env)
        """The environment the replicas start from: the agent's before it prepared its workers'
        (never the workers' hooks or the agent→worker names of :mod:`trainguard.core.envvars`)."""
        for var in list(self._env):
            if var.startswith(envvars.PREFIX):
                del self._env[var]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._procs: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
        self.replicas: dict[str, list[ReplicaState]] = {}
        self.restarts: dict[str, int] = {}
        self.failure: str | None = None
        """The first role failure (one line), None while every role runs."""
        self._budget_spent: set[str] = set()
        """Roles whose restart budget was reported spent (``role_restart_budget_exhausted``)."""
        self.standbys: dict[str, list[StandbyState]] = {}
        self._ready: dict[str, list[tuple[StandbyState, subprocess.Popen[bytes]]]] = {}
        """Ready standbys by role, oldest first (taken by a replica that died)."""
        self._standby_procs: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
        self._ended = threading.Event()
        """Set by :meth:`stop` once every process is ended: a standby thread waits for it
        before it exits (a promoted replica's death signal is tied to the thread that
        started it)."""
        self._niceness = os.getpriority(os.PRIO_PROCESS, 0)
        for spec in self.specs:
            self.standbys[spec.name] = [
                StandbyState(spec, k, _free_port()) for k in range(spec.standby)
            ]
            self._ready[spec.name] = []
        for spec in self.specs:
            url_host = host if spec.nodes else "127.0.0.1"
            mine = range(spec.replicas) if indices is None else indices.get(spec.name, [])
            self.replicas[spec.name] = [
                ReplicaState(
                    spec, i, spec.port + i if spec.port else _free_port(), events.node, url_host
                )
                for i in mine
            ]
            self.restarts[spec.name] = 0
        self.started = False

    # -- what the trainer is told -------------------------------------------------------------
    def urls(self, role: str) -> list[str]:
        return [r.url for r in self.replicas.get(role, [])]

    def trainer_env(self) -> dict[str, str]:
        """``TRAINGUARD_ROLLOUT_URLS`` / ``TRAINGUARD_REWARD_URLS`` for the trainer's workers."""
        return {envvars.ROLE_URLS[name]: ",".join(self.urls(name)) for name in self.replicas}

    def pids(self, role: str) -> list[int | None]:
        return [r.pid for r in self.replicas.get(role, [])]

    def serving(self, role: str) -> int:
        return sum(r.state is S.SERVING for r in self.replicas.get(role, []))

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start every replica's thread (idempotent)."""
        if self.started:
            return
        self.started = True
        for spec in self.specs:
            for rep in self.replicas[spec.name]:
                t = threading.Thread(
                    target=self._run_replica,
                    args=(spec, rep),
                    name=f"trainguard-role-{spec.name}-{rep.index}",
                    daemon=True,
                )
                self._threads.append(t)
                t.start()
            for sb in self.standbys[spec.name]:
                t = threading.Thread(
                    target=self._run_standby,
                    args=(spec, sb),
                    name=f"trainguard-role-{spec.name}-standby-{sb.slot}",
                    daemon=True,
                )
                self._threads.append(t)
                t.start()

    def stop(self) -> None:
        """End every replica: SIGTERM to its process group, SIGKILL after ``stop_timeout_s``."""
        self._stop.set()
        with self._lock:
            procs = [*self._procs.values(), *self._standby_procs.values()]
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.stop_timeout_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if proc.poll() is None:
                _kill_group(proc.pid, signal.SIGKILL)
                try:
                    proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    logger.warning("role replica pid %d did not end after SIGKILL", proc.pid)
            else:  # the leader is gone; its group may not be
                _kill_group(proc.pid, signal.SIGKILL)
        self._ended.set()
        for t in self._threads:
            t.join(timeout=5.0)
        for spec in self.specs:
            for rep in self.replicas[spec.name]:
                if rep.state not in (S.FAILED, S.STOPPED):
                    self._set_state(rep, S.STOPPED, reason="the job ended")
            for sb in self.standbys[spec.name]:
                if sb.state not in (S.FAILED, S.STOPPED):
                    self._set_standby(sb, S.STOPPED, reason="the job ended")

    # -- one replica --------------------------------------------------------------------------
    def _spawn(self, spec: RoleSpec, rep: ReplicaState) -> subprocess.Popen[bytes] | None:
        env = dict(self._env)
        env.update(dict(spec.env))
        env[envvars.ROLE] = spec.name
        env[envvars.ROLE_REPLICA] = str(rep.index)
        env[envvars.ROLE_PORT] = str(rep.port)
        env[envvars.ROLE_HOST] = self._bind[spec.name]
        env[envvars.ROLE_RUN_DIR] = str(self.rundir.root)
        log_path = self.rundir.role_log(spec.name, rep.index)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with os.fdopen(open_append(log_path), "ab") as log:  # never through a symlink
                log.write(f"--- trainguard: start {rep.restarts} at {time.ctime()}\n".encode())
                log.flush()
                proc = subprocess.Popen(
                    list(spec.command),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
        except OSError as e:
            rep.exitcode = None
            rep.reason = f"cannot start {spec.command[0]!r}: {e.strerror or e}"
            return None
        with self._lock:
            self._procs[(spec.name, rep.index)] = proc
        self._started(spec, rep, proc.pid, standby=None)
        self._set_state(rep, S.STARTING, force=True)
        return proc

    def _started(self, spec: RoleSpec, rep: ReplicaState, pid: int, standby: int | None) -> None:
        """Replica ``rep`` runs as ``pid`` now (a fresh process or a promoted standby)."""
        rep.pid = pid
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
            port=rep.port,
            url=rep.url,
            restarts=rep.restarts,
            role_restarts=self.restarts[spec.name],
            command=list(spec.command),
            total=spec.replicas,
            standby=standby,
        )

    def _take_standby(self, spec: RoleSpec, rep: ReplicaState) -> subprocess.Popen[bytes] | None:
        """Promote the oldest ready standby of the role to replica ``rep`` (None: none ready)."""
        while True:
            with self._lock:
                if not self._ready.get(spec.name):
                    return None
                sb, proc = self._ready[spec.name].pop(0)
                if proc.poll() is not None:
                    continue  # died meanwhile: its thread restarts it
                sb.promoted = True
                self._standby_procs.pop((spec.name, sb.slot), None)
                self._procs[(spec.name, rep.index)] = proc
            break
        order = json.dumps({"replica": rep.index, "port": rep.port, "role": spec.name})
        assert sb.promote_path is not None
        write_atomic(sb.promote_path, order + "\n")
        if sb_nice := self.cfg.standby_nice:  # back to the supervisor's priority
            if not _renice(proc.pid, self._niceness):
                logger.info(
                    "role %s: the promoted standby pid %d keeps niceness %d (the OS refuses "
                    "to lower it)",
                    spec.name,
                    proc.pid,
                    sb_nice,
                )
        self._set_standby(sb, S.PROMOTED, reason=f"replaces replica {rep.index}")
        self._started(spec, rep, proc.pid, standby=sb.slot)
        sb.handed.set()
        self._set_state(rep, S.STARTING, force=True)
        return proc

    def _run_replica(self, spec: RoleSpec, rep: ReplicaState) -> None:
        try:
            self._supervise(spec, rep)
        except Exception as e:  # never silent: the role fails with the reason
            logger.exception("role %s replica %d: supervisor error", spec.name, rep.index)
            self._fail(spec, rep, f"supervisor error: {type(e).__name__}: {e}")

    def _supervise(self, spec: RoleSpec, rep: ReplicaState) -> None:
        cfg = self.cfg
        ready_timeout = cfg.readiness_timeout(spec)
        unready_failures = 0
        while not self._stop.is_set():
            proc = None
            if rep.restarts and spec.standby:
                proc = self._take_standby(spec, rep)
            if proc is None:
                proc = self._spawn(spec, rep)
            reason: str | None
            if proc is None:
                reason = rep.reason
            else:
                reason = self._watch(spec, rep, proc, ready_timeout)
            if self._stop.is_set():
                return
            if reason is None:  # never ready within the timeout: not worth another try
                self._fail(
                    spec,
                    rep,
                    f"replica {rep.index} ({' '.join(spec.command)}) never became ready: no "
                    f"'loading' or 'serving' answer on {rep.url}{spec.health_path} within "
                    f"{ready_timeout:g} s (readiness_timeout_s); see "
                    f"{self.rundir.role_log(spec.name, rep.index)}",
                )
                return
            was_ready = rep.ready_at is not None
            unready_failures = 0 if was_ready else unready_failures + 1
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
            with self._lock:
                allowed = spec.restart_policy == "always" and (
                    self.restarts[spec.name] < spec.restart_budget
                )
                if allowed:
                    self.restarts[spec.name] += 1
            if not allowed:
                why = (
                    f"restart budget {spec.restart_budget} spent"
                    if spec.restart_policy == "always"
                    else "restart_policy is never"
                )
                at_once = "" if was_ready else " before it was ever ready"
                self._fail(
                    spec,
                    rep,
                    f"replica {rep.index} ({' '.join(spec.command)}) {reason}{at_once}; "
                    f"{why}; see {self.rundir.role_log(spec.name, rep.index)}",
                    budget=True,
                )
                return
            rep.restarts += 1
            self._set_state(rep, S.RESTARTING, reason=reason)
            backoff = 0.0 if was_ready else min(_MAX_BACKOFF_S, 0.25 * 2 ** (unready_failures - 1))
            if self._stop.wait(backoff):
                return

    def _watch(
        self, spec: RoleSpec, rep: ReplicaState, proc: subprocess.Popen[bytes], ready_timeout: float
    ) -> str | None:
        """Follow one incarnation until it is dead; returns why (None: never ready in time).
        The process group is gone when this returns."""
        cfg = self.cfg
        started = time.monotonic()
        next_probe = started
        last_ok: float | None = None
        answered = False
        while True:
            if self._stop.is_set():
                return "stopped"
            rc = proc.poll()
            if rc is not None:
                rep.exitcode = rc
                _kill_group(proc.pid, signal.SIGKILL)  # what it left in its group
                how = f"exited with code {rc}" if rc >= 0 else f"was killed by signal {-rc}"
                self._set_state(rep, S.DEAD, reason=how)
                return how
            now = time.monotonic()
            if now >= next_probe:
                p = probe_health(
                    rep.port, spec.health_path, cfg.probe_timeout_s, self._probe_host[spec.name]
                )
                now = time.monotonic()
                next_probe = now + cfg.probe_interval_s
                dead = None
                if p.outcome == "ok":
                    answered = True
                    last_ok = now
                    rep.last_ok = time.time()
                    status = p.status
                    if status not in (S.STARTING, S.LOADING, S.SERVING):
                        self._set_state(rep, S.SUSPECT, reason=f"unknown status {str(status)!r}")
                    else:
                        if status in READY_STATUSES and rep.ready_at is None:
                            rep.ready_at = time.time()
                            rep.ever_ready = True
                        self._set_state(rep, status, weight_version=p.weight_version)
                elif p.outcome == "refused" and answered:
                    dead = "refused connections"
                elif answered:
                    self._set_state(rep, S.SUSPECT, reason=p.detail)
                    if last_ok is not None and now - last_ok >= cfg.dead_after_s:
                        dead = f"no good health answer for {now - last_ok:.1f} s ({p.detail})"
                if dead is None and rep.ready_at is None and now - started >= ready_timeout:
                    if rep.ever_ready:  # a replacement that does not come up: a failure
                        dead = f"was not ready {ready_timeout:g} s after its restart"
                    else:
                        self._kill(proc)
                        rep.exitcode = proc.returncode
                        self._set_state(rep, S.DEAD, reason="never ready")
                        return None
                if dead is not None:
                    self._kill(proc)
                    rep.exitcode = proc.returncode
                    self._set_state(rep, S.DEAD, reason=dead)
                    return dead
            self._stop.wait(_POLL_S)

    # -- warm standbys ------------------------------------------------------------------------
    def _run_standby(self, spec: RoleSpec, sb: StandbyState) -> None:
        try:
            self._keep_standby(spec, sb)
        except Exception as e:  # the role goes on with cold restarts; never silent
            logger.exception("role %s standby %d: supervisor error", spec.name, sb.slot)
            self._set_standby(sb, S.FAILED, reason=f"supervisor error: {type(e).__name__}: {e}")
        finally:
            # the processes this thread started (promoted ones too: replicas now) die with it
            # (their parent-death signal): it ends only once stop() ended them its own way
            self._ended.wait()

    def _keep_standby(self, spec: RoleSpec, sb: StandbyState) -> None:
        failures = 0
        while not self._stop.is_set():
            proc = self._spawn_standby(spec, sb)
            why = self._watch_standby(spec, sb, proc) if proc is not None else sb.reason
            if self._stop.is_set():
                return
            if why == "promoted":
                failures = 0
                sb.handed.wait(30.0)
                sb.handed.clear()
                continue  # a new standby behind the promoted one, at once (low priority)
            failures = 0 if sb.ready_at is not None else failures + 1
            if sb.ready_at is None and (why.startswith("answered") or failures >= _STANDBY_GIVE_UP):
                self._set_standby(
                    sb,
                    S.FAILED,
                    reason=f"{why}; the role goes on without this standby (cold restarts); "
                    f"see {self.rundir.role_standby(spec.name, sb.slot, 'log')}",
                )
                return
            self._set_standby(sb, S.DEAD, reason=why)
            backoff = 0.0 if sb.ready_at is not None else min(_MAX_BACKOFF_S, 0.5 * 2**failures)
            if self._stop.wait(backoff):
                return

    def _spawn_standby(self, spec: RoleSpec, sb: StandbyState) -> subprocess.Popen[bytes] | None:
        sb.promoted = False
        sb.ready_at = None
        sb.starts += 1
        promote = self.rundir.role_standby(spec.name, sb.slot, f"{sb.starts}.promote")
        sb.promote_path = promote
        try:
            promote.unlink()  # left by an earlier job in this run directory
        except FileNotFoundError:
            pass
        env = dict(self._env)
        env.update(dict(spec.env))
        env[envvars.ROLE] = spec.name
        env[envvars.ROLE_PORT] = str(sb.port)
        env[envvars.ROLE_HOST] = self._bind[spec.name]
        env[envvars.ROLE_RUN_DIR] = str(self.rundir.root)
        env[envvars.ROLE_STANDBY] = str(promote)
        log_path = self.rundir.role_standby(spec.name, sb.slot, "log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with os.fdopen(open_append(log_path), "ab") as log:
                log.write(f"--- trainguard: standby start {sb.starts} at {time.ctime()}\n".encode())
                log.flush()
                proc = subprocess.Popen(
                    list(spec.command),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_standby_preexec(self.cfg.standby_nice),
                )
        except OSError as e:
            sb.reason = f"cannot start {spec.command[0]!r}: {e.strerror or e}"
            return None
        with self._lock:
            self._standby_procs[(spec.name, sb.slot)] = proc
        sb.pid = proc.pid
        sb.started_at = time.time()
        self._set_standby(sb, S.STARTING, force=True)
        return proc

    def _watch_standby(
        self, spec: RoleSpec, sb: StandbyState, proc: subprocess.Popen[bytes]
    ) -> str:
        """Follow one standby until it is promoted (``"promoted"``) or dead (why; its
        process group is gone then)."""
        cfg = self.cfg
        started = time.monotonic()
        next_probe = started
        last_ok: float | None = None
        ready_timeout = cfg.readiness_timeout(spec)

        def end(why: str) -> str:
            with self._lock:
                if sb.promoted:
                    return "promoted"
                self._standby_procs.pop((spec.name, sb.slot), None)
                pool = self._ready[spec.name]
                pool[:] = [(s, p) for s, p in pool if p is not proc]
            self._kill(proc)
            return why

        while not self._stop.is_set():
            with self._lock:
                if sb.promoted:
                    return "promoted"
            rc = proc.poll()
            if rc is not None:
                return end(f"exited with code {rc}" if rc >= 0 else f"was killed by signal {-rc}")
            now = time.monotonic()
            if now >= next_probe:
                p = probe_health(
                    sb.port, spec.health_path, cfg.probe_timeout_s, self._probe_host[spec.name]
                )
                now = time.monotonic()
                next_probe = now + cfg.probe_interval_s
                if p.outcome == "ok" and p.status in (S.STARTING, S.STANDBY):
                    last_ok = now
                    if p.status is S.STANDBY and sb.ready_at is None:
                        sb.ready_at = time.time()
                        with self._lock:
                            if not sb.promoted:
                                self._ready[spec.name].append((sb, proc))
                        self._set_standby(sb, S.STANDBY)
                elif p.outcome == "ok":
                    return end(
                        f"answered {str(p.status)!r} as a standby: its command does not honour "
                        f"the standby contract ({envvars.ROLE_STANDBY})"
                    )
                elif last_ok is not None and now - last_ok >= cfg.dead_after_s:
                    return end(f"no good health answer for {now - last_ok:.1f} s ({p.detail})")
                if sb.ready_at is None and now - started >= ready_timeout:
                    return end(f"not ready within {ready_timeout:g} s")
            self._stop.wait(_POLL_S)
        return "stopped"

    def _set_standby(
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
            state=state.value,
            previous=previous.value,
            reason=reason,
            pid=sb.pid,
            port=sb.port,
            starts=sb.starts,
        )

    def _kill(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL the replica's process group (a stopped process too) and reap it."""
        _kill_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(10.0)
        except subprocess.TimeoutExpired:
            logger.warning("role replica pid %d survives SIGKILL", proc.pid)

    def _fail(self, spec: RoleSpec, rep: ReplicaState, message: str, budget: bool = False) -> None:
        line = f"role {spec.name} failed: {message}"
        with self._lock:
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
        self._set_state(rep, S.FAILED, reason=message)
        logger.debug("%s", line)  # the agent ends the job with this line

    # -- state ----------------------------------------------------------------------------------
    def _set_state(
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
            state=state.value,
            previous=previous.value,
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
