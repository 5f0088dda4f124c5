"""One replica's state machine, run by a thread of the role supervisor:

    starting → loading → serving → suspect → dead → restarting → starting ...
                                                  ↘ retired | failed

- ``starting``: the process runs and has not answered its health yet, or says so. Until its
  first ready answer only its exit or its readiness deadline counts (the first start:
  ``readiness_timeout_s``; a restart: derived from the role's measured start-up);
- ``loading`` / ``serving``: what ``GET <health_path>`` answers (200, JSON ``status``), counted
  only when the answer names this process (:mod:`trainguard.roles.health`);
- ``suspect``: a probe failed after it answered (a slow process stays suspect while it runs);
- ``dead``: the process exited, refused a connection after it had answered, another process
  answered on its port, or it has been without a good probe for ``dead_after_s`` (a frozen
  process: SIGSTOP); the process group is killed by PID;
- ``restarting``: counted against the role's restart budget, then started again (a ready
  standby of the role's pool promoted, or a cold start) with the same index and port;
- ``retired``: it died ``retire_after`` times, or its port stayed taken: not restarted, the role
  goes on with the others while they are at least its ``floor``;
- ``failed``: the role fails (budget spent, policy ``never``, never ready, below its floor).
"""

from __future__ import annotations

import logging
import subprocess
import time

from trainguard.core.config.roles import RoleSpec
from trainguard.core.contracts.engine import READY_STATUSES
from trainguard.core.contracts.engine import ReplicaStatus as S
from trainguard.roles.health import identity
from trainguard.roles.host import SupervisorHost
from trainguard.roles.liveness import Incarnation
from trainguard.roles.procs import new_incarnation, port_holder, port_is_free, reap, spawn
from trainguard.roles.state import ReplicaState

__all__ = ["ReplicaLoop"]

logger = logging.getLogger(__name__)

_STATUSES = (S.STARTING, S.LOADING, S.SERVING, S.QUARANTINED)
_POLL_S = 0.05
_MAX_BACKOFF_S = 5.0
_PORT_GRACE_S = 2.0
"""How long a port may stay held after its replica's group was killed (its last process
closing) before the holder is reported."""
_SERVING_SLOW_DEAD_AFTERS = 4
"""A serving replica that runs but does not answer is dead after this many ``dead_after_s``."""


class ReplicaLoop:
    """Starts, watches and restarts one replica until the job ends or the replica is
    retired or failed."""

    def __init__(self, sup: SupervisorHost, spec: RoleSpec, rep: ReplicaState) -> None:
        self.sup = sup
        self.spec = spec
        self.rep = rep

    def run(self) -> None:
        try:
            self._supervise()
        except Exception as e:  # never silent: the role fails with the reason
            logger.exception("role %s replica %d: supervisor error", self.spec.name, self.rep.index)
            self.sup.fail(self.spec, self.rep, f"supervisor error: {type(e).__name__}: {e}")

    def _supervise(self) -> None:
        sup, spec, rep, cfg = self.sup, self.spec, self.rep, self.sup.cfg
        unready_failures = 0
        while not sup.stopping.is_set():
            if not self._acquire_port():
                if not sup.stopping.is_set():
                    sup.retire(spec, rep, f"its port {rep.port} stayed taken by another process")
                return
            fresh = True
            started: tuple[subprocess.Popen[bytes], str] | None = None
            pool = sup.pools.get(spec.name)
            if rep.restarts and pool is not None:
                taken = pool.take(rep)
                if taken is not None:
                    proc, sb = taken
                    incarnation = sb.incarnation  # the slot's next start takes a new one
                    assert incarnation is not None
                    sup.replica_started(spec, rep, proc.pid, incarnation, standby=sb.slot)
                    pool.handed(sb)
                    sup.set_state(rep, S.STARTING, force=True)
                    started, fresh = (proc, incarnation), False
            if started is None:
                started = self._spawn()
            first = not rep.ever_ready and rep.restarts == 0
            deadline = (
                cfg.readiness_timeout(spec)
                if first
                else cfg.restart_deadline(spec, sup.startup_s.get(spec.name))
            )
            reason: str | None
            if started is None:
                reason = rep.reason
            else:
                reason = self._watch(*started, deadline, fresh=fresh)
            if sup.stopping.is_set():
                return
            if reason is None:  # never ready within the timeout: not worth another try
                sup.fail(
                    spec,
                    rep,
                    f"replica {rep.index} ({' '.join(spec.command)}) never became ready: no "
                    f"'loading' or 'serving' answer on {rep.url}{spec.health_path} within "
                    f"{deadline:g} s (readiness_timeout_s); see "
                    f"{sup.rundir.role_log(spec.name, rep.index)}",
                )
                return
            was_ready = rep.ready_at is not None
            if not was_ready and not self._port_free_soon():
                # it could not bind: another process took the port; not the replica's fault
                # and not a restart of the budget: wait for the port (bounded), then retire
                sup.set_state(rep, S.DEAD, reason=f"{reason}; its port {rep.port} is taken")
                continue
            unready_failures = 0 if was_ready else unready_failures + 1
            sup.replica_failed(spec, rep, reason, was_ready)
            if not sup.allow_restart(spec, rep, reason, was_ready):
                return
            rep.restarts += 1
            sup.set_state(rep, S.RESTARTING, reason=reason)
            backoff = 0.0 if was_ready else min(_MAX_BACKOFF_S, 0.25 * 2 ** (unready_failures - 1))
            if sup.stopping.wait(backoff):
                return

    # -- the port -------------------------------------------------------------------------------
    def _port_free_soon(self) -> bool:
        host = self.sup.bind_host[self.spec.name]
        deadline = time.monotonic() + _PORT_GRACE_S
        while not port_is_free(self.rep.port, host):
            if time.monotonic() >= deadline or self.sup.stopping.wait(0.1):
                return False
        return True

    def _acquire_port(self) -> bool:
        """True once the replica's port is free (at once, normally); while another process
        holds it, one ``role_port_taken`` event names that process; False after
        ``port_wait_s`` (or the job ending)."""
        sup, spec, rep = self.sup, self.spec, self.rep
        if self._port_free_soon():
            return True
        pid, cmd = port_holder(rep.port)
        if not cmd:
            p = sup.probe(spec, rep.port)
            cmd = f"health answer: {identity(p)}" if p.outcome == "ok" else "unknown process"
        t0 = time.monotonic()
        sup.port_taken(spec, rep, pid, cmd, 0.0)
        while not sup.stopping.wait(0.25):
            if port_is_free(rep.port, sup.bind_host[spec.name]):
                return True
            if time.monotonic() - t0 >= sup.cfg.port_wait_s:
                sup.port_taken(spec, rep, pid, cmd, round(time.monotonic() - t0, 1))
                return False
        return False

    # -- one incarnation ------------------------------------------------------------------------
    def _spawn(self) -> tuple[subprocess.Popen[bytes], str] | None:
        sup, spec, rep = self.sup, self.spec, self.rep
        incarnation = new_incarnation()
        try:
            proc = spawn(
                spec.command,
                sup.role_env(spec, rep.port, incarnation, replica=rep.index),
                sup.rundir.role_log(spec.name, rep.index),
                f"start {rep.restarts}",
            )
        except OSError as e:
            rep.exitcode = None
            rep.reason = f"cannot start {spec.command[0]!r}: {e.strerror or e}"
            return None
        with sup.lock:
            sup.procs[(spec.name, str(rep.index))] = proc
        sup.replica_started(spec, rep, proc.pid, incarnation, standby=None)
        sup.set_state(rep, S.STARTING, force=True)
        return proc, incarnation

    def _watch(
        self, proc: subprocess.Popen[bytes], incarnation: str, deadline: float, *, fresh: bool
    ) -> str | None:
        """Follow one incarnation until it is dead; returns why (None: never ready in time,
        never ready before either). The process group is gone when this returns."""
        sup, spec, rep, cfg = self.sup, self.spec, self.rep, self.sup.cfg
        inc = Incarnation(
            proc.pid,
            incarnation,
            ready_deadline_s=deadline,
            dead_after_s=cfg.dead_after_s,
            ready_statuses=READY_STATUSES,
            slow_limit_s=_SERVING_SLOW_DEAD_AFTERS * cfg.dead_after_s,
        )
        squatter_told = False
        next_probe = time.monotonic()
        while True:
            if sup.stopping.is_set():
                return S.STOPPED
            rc = proc.poll()
            if rc is not None:
                rep.exitcode = rc
                reap(proc)  # what it left in its group
                how = f"exited with code {rc}" if rc >= 0 else f"was killed by signal {-rc}"
                sup.set_state(rep, S.DEAD, reason=how)
                return how
            if time.monotonic() < next_probe:
                sup.stopping.wait(_POLL_S)
                continue
            p = sup.probe(spec, rep.port)
            next_probe = time.monotonic() + cfg.probe_interval_s
            j = inc.judge(p, ready=rep.ready_at is not None)
            dead: str | None = None
            if j.verdict == "ok":
                rep.last_ok = time.time()
                if j.status is None or j.status not in _STATUSES:
                    sup.set_state(rep, S.SUSPECT, reason=f"unknown status {str(j.status)!r}")
                else:
                    if j.status in READY_STATUSES and rep.ready_at is None:
                        rep.ready_at = time.time()
                        rep.ever_ready = True
                        if fresh:
                            sup.note_startup(spec, inc.startup_s())
                    dead = sup.answered(spec, rep, j.status, p.weight_version)
            elif j.verdict == "foreign" and not squatter_told:
                squatter_told = True
                pid = p.health.pid if p.health is not None else None
                sup.port_taken(spec, rep, pid, f"health answer: {identity(p)}", 0.0)
            elif j.verdict == "wait" and j.suspect:
                sup.set_state(rep, S.SUSPECT, reason=j.detail)
            elif j.verdict == "late":
                if not rep.ever_ready:
                    reap(proc)
                    rep.exitcode = proc.returncode
                    sup.set_state(rep, S.DEAD, reason="never ready")
                    return None
                dead = f"was not ready {deadline:g} s after its restart"
            elif j.verdict == S.DEAD:
                dead = j.detail
            if dead is not None:
                reap(proc)
                rep.exitcode = proc.returncode
                sup.set_state(rep, S.DEAD, reason=dead)
                return dead
