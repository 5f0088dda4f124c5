"""Liveness apart from readiness, for one incarnation of a replica or a standby.

- **Start-up** (no answer of its own yet): only the process's exit or a missed readiness
  deadline counts. Probes that time out or are refused are the process still importing; an
  answer from another process on the port is a squatter (reported, never counted).
- **Up** (it answered): a refused connection is death at once (its server is gone); an answer
  from another process too (its port is someone else's). Without a good answer of its own for
  ``dead_after_s`` it is dead, unless it is *slow*: a probe that got no answer at all while
  its process group is running and using CPU (a niced process starved by the load) is given
  up to ``slow_limit_s``. A stopped process (SIGSTOP) makes no progress: dead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from trainguard.core.contracts.engine import ReplicaStatus as S
from trainguard.roles.health import Probe, Whose, identity, whose
from trainguard.roles.procs import progress

__all__ = ["Incarnation", "Judgement"]

_NO_ANSWER = ("timeout", "error")
"""Probe outcomes that may be a slow process (no answer yet), not a wrong one."""


@dataclass(frozen=True, slots=True)
class Judgement:
    """What one probe means."""

    verdict: str
    """``ok`` (an answer of its own: ``status``), ``wait`` (nothing decided: start-up, or
    suspect but not dead yet), ``foreign`` (another process answered: ``detail`` names it),
    ``dead`` (``detail``: why), ``late`` (missed its readiness deadline)."""
    status: S | None = None
    detail: str = ""
    suspect: bool = False
    """A failed probe after it answered (the replica is ``suspect``)."""


class Incarnation:
    """One start of a process, as its probes see it."""

    def __init__(
        self,
        pgid: int,
        incarnation: str,
        *,
        ready_deadline_s: float,
        dead_after_s: float,
        slow_limit_s: float,
        ready_statuses: tuple[str, ...],
    ) -> None:
        self.pgid = pgid
        self.incarnation = incarnation
        self.started = time.monotonic()
        self.ready_deadline_s = ready_deadline_s
        self.dead_after_s = dead_after_s
        self.slow_limit_s = max(slow_limit_s, dead_after_s)
        self.ready_statuses = ready_statuses
        self.answered = False
        self.last_ok: float | None = None
        self._cpu: int | None = None

    def startup_s(self) -> float:
        return time.monotonic() - self.started

    def judge(self, p: Probe, ready: bool, now: float | None = None) -> Judgement:
        """``ready``: the process has proved readiness (its own ready answer) already."""
        now = time.monotonic() if now is None else now
        if p.outcome == "ok":
            who = whose(p, self.pgid, self.incarnation)
            if who is Whose.OWN:
                self.answered = True
                self.last_ok = now
                self._cpu = None
                if p.status not in self.ready_statuses and (late := self._deadline(ready, now)):
                    return late
                return Judgement("ok", status=p.status)
            if who is Whose.FOREIGN:
                detail = f"port answered by another process ({identity(p)})"
                if self.answered:
                    return Judgement(S.DEAD, detail=detail)
                return self._deadline(ready, now) or Judgement("foreign", detail=detail)
            detail = "health answer names no process (pid, incarnation)"
            return self._up_failure(p, detail, ready, now, no_answer=False)
        if not self.answered:
            return self._deadline(ready, now) or Judgement("wait")
        if p.outcome == "refused":
            return Judgement(S.DEAD, detail="refused connections")
        return self._up_failure(p, p.detail, ready, now, no_answer=p.outcome in _NO_ANSWER)

    def _deadline(self, ready: bool, now: float) -> Judgement | None:
        if not ready and now - self.started >= self.ready_deadline_s:
            return Judgement("late", detail=f"not ready within {self.ready_deadline_s:g} s")
        return None

    def _up_failure(
        self, p: Probe, detail: str, ready: bool, now: float, *, no_answer: bool
    ) -> Judgement:
        if self.last_ok is None:  # answered only with answers that do not count
            return self._deadline(ready, now) or Judgement("wait", detail=detail, suspect=True)
        silent = now - self.last_ok
        if silent < self.dead_after_s:
            return Judgement("wait", detail=detail, suspect=True)
        why = f"no good health answer for {silent:.1f} s ({detail})"
        if no_answer and silent < self.slow_limit_s and self._progressing():
            return Judgement("wait", detail=f"slow: {detail}; its process runs", suspect=True)
        return Judgement(S.DEAD, detail=why)

    def _progressing(self) -> bool:
        """Whether the process group used CPU since the last look and is not stopped."""
        now = progress(self.pgid)
        if now is None or now.stopped:
            return False
        before, self._cpu = self._cpu, now.cpu_ticks
        return before is None or now.cpu_ticks > before
