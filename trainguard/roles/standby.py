"""The warm standbys of one role: a pool of ``standby = K`` processes for the whole role.

Each slot has a thread that keeps one standby running: started with the role's command at low
CPU priority (``[roles] standby_nice``), ``TRAINGUARD_ROLE_STANDBY`` naming its promotion file,
on a fresh port of its own for each start (never routed to). A standby is ready once *its own*
health answer (its incarnation) says ``standby``; only a ready one is promoted. One that stops
answering is ``suspect``, out of the pool until it answers again: a starved standby is slow, not
dead; it is dead when its process exits, refuses connections after it answered, or has been
silent for the role's readiness timeout.

A replica that dies takes the oldest ready standby (:meth:`StandbyPool.take`): the pool writes
its promotion file (the replica's port, how long to wait for it), the standby takes the port
and reports ``loading`` until it holds the current weights. The slot starts a new standby behind
it at once, so K deaths in a row are each covered while the others start.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time

from trainguard.core.atomicfile import write_atomic
from trainguard.core.config.roles import RoleSpec
from trainguard.core.contracts import envvars
from trainguard.core.contracts.engine import ReplicaStatus as S
from trainguard.roles.host import SupervisorHost
from trainguard.roles.liveness import Incarnation
from trainguard.roles.procs import new_incarnation, reap, renice, spawn
from trainguard.roles.state import ReplicaState, StandbyState

__all__ = ["StandbyPool"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_MAX_BACKOFF_S = 5.0
_GIVE_UP = 3
"""A slot that failed this many times in a row before it was ever ready stops: the role goes
on with cold restarts (one ``role_standby_state`` ``failed`` event says why)."""


class StandbyPool:
    """The standbys of one role (``spec.standby`` slots, one thread each)."""

    def __init__(self, sup: SupervisorHost, spec: RoleSpec) -> None:
        self.sup = sup
        self.spec = spec
        self.slots = [StandbyState(spec, k) for k in range(spec.standby)]
        self._ready: list[tuple[StandbyState, subprocess.Popen[bytes]]] = []
        """Ready standbys, oldest first (under the supervisor's lock)."""

    # -- the replica's side ---------------------------------------------------------------------
    def take(self, rep: ReplicaState) -> tuple[subprocess.Popen[bytes], StandbyState] | None:
        """Promote the oldest ready standby to replica ``rep`` (None: none ready). The caller
        records the replica's start, then calls :meth:`handed`."""
        sup, spec = self.sup, self.spec
        while True:
            with sup.lock:
                if not self._ready:
                    return None
                sb, proc = self._ready.pop(0)
                if proc.poll() is not None:
                    continue  # died meanwhile: its thread restarts it
                sb.promoted = True
                sup.procs.pop((spec.name, f"standby-{sb.slot}"), None)
                sup.procs[(spec.name, str(rep.index))] = proc
                sup.set_standby(sb, S.PROMOTED, reason=f"replaces replica {rep.index}")
            break
        order = {
            "replica": rep.index,
            "port": rep.port,
            "role": spec.name,
            "port_wait_s": sup.cfg.port_wait_s,
        }
        assert sb.promote_path is not None
        write_atomic(sb.promote_path, json.dumps(order) + "\n")
        if sb_nice := sup.cfg.standby_nice:  # back to the supervisor's priority
            if not renice(proc.pid, sup.niceness):
                logger.info(
                    "role %s: the promoted standby pid %d keeps niceness %d (the OS refuses "
                    "to lower it)",
                    spec.name,
                    proc.pid,
                    sb_nice,
                )
        return proc, sb

    def handed(self, sb: StandbyState) -> None:
        sb.handed.set()

    # -- one slot -------------------------------------------------------------------------------
    def run_slot(self, sb: StandbyState) -> None:
        try:
            self._keep(sb)
        except Exception as e:  # the role goes on with cold restarts; never silent
            logger.exception("role %s standby %d: supervisor error", self.spec.name, sb.slot)
            self.sup.set_standby(sb, S.FAILED, reason=f"supervisor error: {type(e).__name__}: {e}")
        finally:
            # the processes this thread started (promoted ones too: replicas now) die with it
            # (their parent-death signal): it ends only once stop() ended them its own way
            self.sup.ended.wait()

    def _keep(self, sb: StandbyState) -> None:
        sup, spec = self.sup, self.spec
        failures = 0
        while not sup.stopping.is_set():
            proc = self._spawn(sb)
            why = self._watch(sb, proc) if proc is not None else sb.reason
            if sup.stopping.is_set():
                return
            if why == S.PROMOTED:
                failures = 0
                sb.handed.wait(30.0)
                sb.handed.clear()
                continue  # a new standby behind the promoted one, at once (low priority)
            failures = 0 if sb.ready_at is not None else failures + 1
            if sb.ready_at is None and (why.startswith("answered") or failures >= _GIVE_UP):
                sup.set_standby(
                    sb,
                    S.FAILED,
                    reason=f"{why}; the role goes on without this standby (cold restarts); "
                    f"see {sup.rundir.role_standby(spec.name, sb.slot, 'log')}",
                )
                return
            sup.set_standby(sb, S.DEAD, reason=why)
            backoff = 0.0 if sb.ready_at is not None else min(_MAX_BACKOFF_S, 0.5 * 2**failures)
            if sup.stopping.wait(backoff):
                return

    def _spawn(self, sb: StandbyState) -> subprocess.Popen[bytes] | None:
        sup, spec = self.sup, self.spec
        sb.promoted = False
        sb.ready_at = None
        sb.starts += 1
        promote = sup.rundir.role_standby(spec.name, sb.slot, f"{sb.starts}.promote")
        sb.promote_path = promote
        try:
            promote.unlink()  # left by an earlier job in this run directory
        except FileNotFoundError:
            pass
        sb.port = sup.standby_port(spec)
        sb.incarnation = new_incarnation()
        env = sup.role_env(spec, sb.port, sb.incarnation)
        env[envvars.ROLE_STANDBY] = str(promote)
        try:
            proc = spawn(
                spec.command,
                env,
                sup.rundir.role_standby(spec.name, sb.slot, "log"),
                f"standby start {sb.starts}",
                nice=sup.cfg.standby_nice,
            )
        except OSError as e:
            sb.reason = f"cannot start {spec.command[0]!r}: {e.strerror or e}"
            return None
        with sup.lock:
            sup.procs[(spec.name, f"standby-{sb.slot}")] = proc
        sb.pid = proc.pid
        sb.started_at = time.time()
        sup.set_standby(sb, S.STARTING, force=True)
        return proc

    def _watch(self, sb: StandbyState, proc: subprocess.Popen[bytes]) -> str:
        """Follow one standby until it is promoted (``S.PROMOTED``) or dead (why; its
        process group is gone then)."""
        sup, spec, cfg = self.sup, self.spec, self.sup.cfg
        timeout = cfg.readiness_timeout(spec)
        assert sb.incarnation is not None
        # a standby is needed by nobody yet: silence makes it unready (suspect), not dead,
        # for as long as a start-up may take
        inc = Incarnation(
            proc.pid,
            sb.incarnation,
            ready_deadline_s=timeout,
            dead_after_s=timeout,
            ready_statuses=(S.STANDBY,),
            slow_limit_s=timeout,
        )
        next_probe = time.monotonic()

        def end(why: str) -> str:
            with sup.lock:
                if sb.promoted:
                    return S.PROMOTED
                sup.procs.pop((spec.name, f"standby-{sb.slot}"), None)
                self._ready[:] = [(s, p) for s, p in self._ready if p is not proc]
            reap(proc)
            return why

        while not sup.stopping.is_set():
            with sup.lock:
                if sb.promoted:
                    return S.PROMOTED
            rc = proc.poll()
            if rc is not None:
                return end(f"exited with code {rc}" if rc >= 0 else f"was killed by signal {-rc}")
            if time.monotonic() >= next_probe:
                p = sup.probe(spec, sb.port)
                next_probe = time.monotonic() + cfg.probe_interval_s
                with sup.lock:
                    if sb.promoted:  # taken while the probe waited: the answer is stale
                        return S.PROMOTED
                j = inc.judge(p, ready=sb.ready_at is not None)
                if j.verdict == "ok" and j.status in (S.STARTING, S.STANDBY):
                    if j.status == S.STANDBY:
                        if sb.ready_at is None:
                            sb.ready_at = time.time()
                        with sup.lock:  # a promotion comes between, or after the event
                            if sb.promoted:
                                return S.PROMOTED
                            if all(q is not proc for _, q in self._ready):
                                self._ready.append((sb, proc))
                            sup.set_standby(sb, S.STANDBY)
                elif j.verdict == "ok":
                    return end(
                        f"answered {str(j.status)!r} as a standby: its command does not honour "
                        f"the standby contract ({envvars.ROLE_STANDBY})"
                    )
                elif j.verdict in (S.DEAD, "late"):
                    return end(j.detail)
                elif j.suspect:
                    with sup.lock:
                        if sb.promoted:
                            return S.PROMOTED
                        self._ready[:] = [(s, q) for s, q in self._ready if q is not proc]
                        sup.set_standby(sb, S.SUSPECT, reason=j.detail)
            sup.stopping.wait(_POLL_S)
        return S.STOPPED
