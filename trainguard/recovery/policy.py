"""Failure → action: what a node's agent does when its worker group failed.

==========================================  ======================  ===========================
failure                                     action                  exit code
==========================================  ======================  ===========================
workers saved after a preemption signal     requeue                 75
a worker's configuration error              stop the job            93 (every agent)
a deterministic user-code error or an       stop the job            93 (every agent)
out-of-memory error (attribution)
a hardware error a worker raised            evict this node         94
job-wide restart budget spent               stop the job            93 (every agent)
``crash_loop_restarts`` restarts in a row   stop the job            93 (every agent)
without checkpoint progress
this node's own workers failed              evict this node         94 (this node; the
``node_failure_limit`` times in the window                          others restart without it)
anything else (crash, kill, hang, a peer)   restart the group       (after the backoff)
==========================================  ======================  ===========================

The job-wide part (budget, crash loop, backoff) is decided once per failed round: the first
agent to claim the attempt in the :class:`~trainguard.recovery.ledger.JobLedger` decides and
publishes; every other agent whose workers failed in that round reads the same decision.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from trainguard.core.config.recovery import RecoveryConfig
from trainguard.core.contracts.actions import RecoveryAction
from trainguard.core.failures import (
    DO_NOT_REQUEUE_EXIT_CODE,
    FailureKind,
    WorkerFailure,
    peer_failure_text,
)
from trainguard.recovery.attribution import Attribution, Cause, Verdict, attribute
from trainguard.recovery.ledger import JobLedger

__all__ = [
    "RecoveryAction",
    "RecoveryDecision",
    "RecoveryPolicy",
    "backoff_s",
    "config_error",
    "own_failure",
]


@dataclass(frozen=True, slots=True)
class RecoveryDecision:
    action: RecoveryAction
    reason: str
    attempt: int
    job_restarts: int
    """Job-wide restarts made, this one included when the action is a restart."""
    backoff_s: float = 0.0
    decided_by: str = ""
    attribution: dict[str, Any] = field(default_factory=dict, compare=False)
    """This node's :class:`Attribution` of the failure (cause, verdict, summary, evidence)."""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "action": self.action.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecoveryDecision:
        return cls(**{**d, "action": RecoveryAction(d["action"])})


def backoff_s(restart: int, *, base_s: float, cap_s: float) -> float:
    """Wait before the job's ``restart``-th restart (1-based): none before the first, then
    ``base_s``, doubling, at most ``cap_s``."""
    if restart <= 1 or base_s <= 0:
        return 0.0
    return float(min(cap_s, base_s * 2 ** (restart - 2)))


def own_failure(failures: list[WorkerFailure]) -> bool:
    """Whether a failure is this node's own: a worker died of a signal other than a teardown
    SIGTERM, or raised an exception that is not a survivor's view of a peer's loss. An exit 1
    without an error file is ambiguous (a survivor's collective error looks the same) and does
    not count."""
    for f in failures:
        if f.kind in (FailureKind.KILLED, FailureKind.CRASHED):
            return True
        if f.kind is FailureKind.EXCEPTION and peer_failure_text(f.message or "") is None:
            return True
    return False


def config_error(failures: list[WorkerFailure], cfg: RecoveryConfig) -> str | None:
    """A reason when a failure is a configuration error that no restart can fix."""
    for f in failures:
        if f.exitcode == DO_NOT_REQUEUE_EXIT_CODE and f.signal is None:
            # the worker itself said no restart can help (e.g. repeated loss rollbacks at the
            # same place): stop the whole job, not only this node
            return f"rank {f.rank} exited with {DO_NOT_REQUEUE_EXIT_CODE} (do not requeue)"
        if f.exitcode in cfg.stop_on_exit_codes and f.signal is None:
            return f"configuration error: rank {f.rank} exited with {f.exitcode}"
        if f.message:
            head = f.message.split(":", 1)[0].strip().rsplit(".", 1)[-1]
            if head in cfg.stop_on_errors:
                first = f.message.strip().splitlines()[0][:300]
                return f"configuration error on rank {f.rank}: {first}"
    return None


def _requeue(failures: list[WorkerFailure]) -> bool:
    kinds = {f.kind for f in failures}
    return FailureKind.PREEMPTED in kinds and kinds <= {
        FailureKind.PREEMPTED,
        FailureKind.TERMINATED,
    }


def _describe(failures: list[WorkerFailure]) -> str:
    parts = []
    for f in failures[:4]:
        how = f.signal or f"exit {f.exitcode}"
        parts.append(f"rank {f.rank} {f.kind.value} ({how})")
    more = f" and {len(failures) - 4} more" if len(failures) > 4 else ""
    return "; ".join(parts) + more if parts else "the worker group was declared unhealthy"


class RecoveryPolicy:
    """Decides for one node (``node``); the job-wide part goes through ``ledger``."""

    def __init__(self, cfg: RecoveryConfig, ledger: JobLedger, *, node: str) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.node = node
        self._own_failures: deque[float] = deque()

    def decide(
        self,
        attempt: int,
        failures: list[WorkerFailure],
        *,
        now: float | None = None,
        evictable: bool = True,
        hang: bool = False,
        ran_s: float | None = None,
        world_size: int = 0,
        health: list[dict[str, Any]] | None = None,
    ) -> RecoveryDecision:
        """The action for this node after its workers failed in ``attempt``. ``evictable``:
        the job could go on without this node (False for a single-node job); ``hang``: the
        agent killed its hung workers (every node's detector may do that for one hang: it is
        not counted against the node); ``ran_s``: how long the failed attempt's workers ran
        (``backoff_reset_s``); ``world_size``: the job's ranks; ``health``: the in-job health
        findings (``health_unhealthy``) of the attempt."""
        d = self._decide(attempt, failures, now, evictable, hang, ran_s, world_size, health)
        return d

    def attribute(
        self,
        attempt: int,
        failures: list[WorkerFailure],
        *,
        world_size: int,
        hang: bool,
        health: list[dict[str, Any]] | None,
    ) -> Attribution | None:
        """This node's attribution of the failed ``attempt`` (None when switched off); a
        user-code signature is recorded for the next attempt's "twice in a row"."""
        if not self.cfg.attribution:
            return None
        try:
            previous = self.ledger.signature(attempt - 1, self.node)
        except Exception:  # the store is unreachable: no second-attempt evidence
            previous = None
        a = attribute(
            failures,
            world_size=max(world_size, 1),
            health=health,
            hang=hang,
            previous_signature=previous,
        )
        if a.signature:
            try:
                self.ledger.record_signature(attempt, self.node, a.signature)
                if a.cause is Cause.USER_CODE and not a.deterministic and a.evidence.get("alone"):
                    # every node's ranks count: the same place on every rank of the job, on
                    # whichever nodes they run, is deterministic too (the node that completes
                    # the count stops the job; the others learn the stop before restarting)
                    total = self.ledger.count_signature_ranks(attempt, a.signature, len(a.ranks))
                    # the other nodes' ranks raise within moments: wait for them (bounded)
                    deadline = time.monotonic() + self.cfg.failure_grace_s
                    while total < world_size and time.monotonic() < deadline:
                        time.sleep(0.1)
                        total = self.ledger.count_signature_ranks(attempt, a.signature, 0)
                    if total >= world_size > len(a.ranks):
                        why = f"on all {world_size} rank(s) of the job"
                        a.verdict, a.deterministic = Verdict.STOP, True
                        a.summary = a.summary.rsplit(" (", 1)[0] + f" ({why})"
                        a.evidence["decided"] = why
            except Exception:
                pass
        return a

    def _decide(
        self,
        attempt: int,
        failures: list[WorkerFailure],
        now: float | None,
        evictable: bool,
        hang: bool,
        ran_s: float | None,
        world_size: int,
        health: list[dict[str, Any]] | None,
    ) -> RecoveryDecision:
        now = time.time() if now is None else now
        if _requeue(failures):
            return RecoveryDecision(
                RecoveryAction.REQUEUE,
                "the workers saved a preemption checkpoint and asked to be requeued",
                attempt,
                self.ledger.restarts(),
                decided_by=self.node,
            )
        attr = self.attribute(attempt, failures, world_size=world_size, hang=hang, health=health)
        seen = attr.to_dict() if attr is not None else {}
        stop = self.ledger.stopped()
        if stop is None:
            reason = config_error(failures, self.cfg)
            if reason is None and attr is not None and attr.verdict is Verdict.STOP:
                reason = f"{attr.cause.value.replace('_', ' ')}: {attr.summary}"
            if reason is not None:
                stop = self.ledger.stop(reason, by=self.node, now=now)
        if stop is not None:
            return RecoveryDecision(
                RecoveryAction.STOP,
                stop["reason"],
                attempt,
                self.ledger.restarts(),
                decided_by=stop["by"],
                attribution=seen,
            )
        own = own_failure(failures) and not hang
        job = self._job_decision(attempt, failures, ran_s)
        hardware = (
            attr is not None
            and attr.cause in (Cause.HARDWARE, Cause.SDC)
            and attr.verdict is Verdict.EVICT
            and not health  # a health drain evicts on its own path
        )
        if job.action is RecoveryAction.RESTART and evictable and hardware and attr is not None:
            return RecoveryDecision(
                RecoveryAction.EVICT,
                f"node {self.node}: {attr.cause.value}: {attr.summary}",
                attempt,
                job.job_restarts,
                decided_by=self.node,
                attribution=seen,
            )
        if job.action is RecoveryAction.RESTART and own and self._count_own(now) and evictable:
            n, window = self.cfg.node_failure_limit, self.cfg.node_failure_window_s
            return RecoveryDecision(
                RecoveryAction.EVICT,
                f"node {self.node} failed {n} times within {window:g} s "
                f"(this time: {_describe(failures)})",
                attempt,
                job.job_restarts,
                decided_by=self.node,
                attribution=seen,
            )
        return replace(job, attribution=seen)

    def _count_own(self, now: float) -> bool:
        """Record one own failure; True when the node reached the eviction limit."""
        limit = self.cfg.node_failure_limit
        self._own_failures.append(now)
        while self._own_failures and self._own_failures[0] < now - self.cfg.node_failure_window_s:
            self._own_failures.popleft()
        return limit > 0 and len(self._own_failures) >= limit

    def _job_decision(
        self, attempt: int, failures: list[WorkerFailure], ran_s: float | None = None
    ) -> RecoveryDecision:
        """The job-wide decision for the failed ``attempt``: taken here or read."""
        if self.ledger.claim(attempt):
            return self._publish(attempt, self._decide_job(attempt, failures, ran_s=ran_s))
        got = self.ledger.decision(attempt, timeout_s=self.cfg.decision_timeout_s)
        if got is not None:
            return RecoveryDecision.from_dict(got)
        # The deciding agent is gone (its node died): decide here, without counting again.
        return self._publish(attempt, self._decide_job(attempt, failures, count=False, ran_s=ran_s))

    def _publish(self, attempt: int, decision: RecoveryDecision) -> RecoveryDecision:
        final = RecoveryDecision.from_dict(
            self.ledger.publish_decision(attempt, decision.to_dict())
        )
        if final.action is RecoveryAction.STOP:
            self.ledger.stop(final.reason, by=final.decided_by)
        return final

    def _decide_job(
        self,
        attempt: int,
        failures: list[WorkerFailure],
        *,
        count: bool = True,
        ran_s: float | None = None,
    ) -> RecoveryDecision:
        cfg, ledger = self.cfg, self.ledger
        made = ledger.restarts()
        what = _describe(failures)

        def stop(reason: str) -> RecoveryDecision:
            return RecoveryDecision(
                RecoveryAction.STOP, reason, attempt, made, decided_by=self.node
            )

        budget = cfg.job_restart_budget
        if budget is not None and made >= budget:
            return stop(
                f"job restart budget spent: {made} of {budget} job-wide restarts made (now: {what})"
            )
        step = ledger.checkpoint_step()
        mark_step, mark_restarts = ledger.progress_mark()
        if step > mark_step:
            ledger.set_progress_mark(step, made)
            mark_restarts = made
        idle = made - mark_restarts
        if cfg.crash_loop_restarts and step >= 0 and idle >= cfg.crash_loop_restarts:
            return stop(
                f"crash loop: {idle} restarts without checkpoint progress (newest committed "
                f"step {step}; now: {what})"
            )
        n = ledger.count_restart() if count else made + 1
        # The backoff grows with the restarts made since the job last made checkpoint progress
        # (not with every restart of the job's life): a job that trains between failures
        # restarts at once every time; one that keeps failing waits 1 s, 2 s, 4 s ...
        # ... and so does an attempt that ran backoff_reset_s before it failed.
        ran_long = cfg.backoff_reset_s > 0 and (ran_s or 0.0) >= cfg.backoff_reset_s
        wait = backoff_s(
            1 if ran_long else idle + 1, base_s=cfg.backoff_base_s, cap_s=cfg.backoff_cap_s
        )
        limit = f" of {budget}" if budget is not None else ""
        return RecoveryDecision(
            RecoveryAction.RESTART,
            f"job-wide restart {n}{limit} after: {what}",
            attempt,
            n,
            backoff_s=wait,
            decided_by=self.node,
        )
