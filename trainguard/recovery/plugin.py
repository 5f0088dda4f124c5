"""The recovery agent plugin: carries out :class:`~trainguard.recovery.policy.RecoveryPolicy`.

- before every rendezvous: a blocklisted node refuses to join (exit 94, one line saying until
  when); a job that was stopped elsewhere stops here too (exit 93); the restart backoff waits;
- on a failed worker group: decide (event ``recovery_decision``) and act: restart (torch's),
  stop the job (:class:`JobStopError`), evict this node (:class:`NodeEvictedError`);
- every monitor tick (about once a second): a job-wide stop published by another agent stops
  this one; newly committed checkpoints (``checkpoint_committed`` events in the run directory)
  raise the job's checkpoint step in the store;
- when the agent ends: an in-job health ``drain`` verdict (``node_excluded`` with action drain)
  becomes an eviction (the node is recorded on the blocklist and fenced); a rendezvous closed by
  a job-wide stop becomes that stop. Other exclusions (a straggler) stay exclusions (exit 1).

Events: ``failure_attributed`` (this node's cause, verdict and evidence of a failed round,
:mod:`trainguard.recovery.attribution`), ``recovery_decision`` (action, reason, job_restarts,
budget, backoff_s, decided_by, verdict, failure_cause),
``node_evicted`` (reason, until, fenced, detail), ``node_refused`` (blocklisted, until),
``node_readmitted`` (the cooldown passed).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.core.contracts.actions import HealthAction
from trainguard.core.contracts.event_kinds import (
    FAILURE_ATTRIBUTED,
    HANG_KILLED,
    HEALTH_UNHEALTHY,
    NODE_EVICTED,
    NODE_EXCLUDED,
    NODE_READMITTED,
    NODE_REFUSED,
    RECOVERY_DECISION,
)
from trainguard.core.contracts.jobstate import JobState
from trainguard.core.events import EVENTS_FILE
from trainguard.core.fencing import NodeFencer, RecordOnlyFencer
from trainguard.core.plugin import (
    AgentContext,
    AgentPlugin,
    JobStopError,
    NodeEvictedError,
    NodeUnhealthyError,
)
from trainguard.recovery.ledger import JobLedger
from trainguard.recovery.policy import RecoveryAction, RecoveryDecision, RecoveryPolicy

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

    from trainguard.core.failures import WorkerFailure

__all__ = ["RecoveryPlugin"]

logger = logging.getLogger(__name__)

ERROR_FILE_HOOK = "trainguard.core.errorfile:install_excepthook"
"""The worker start-up hook entry that records an uncaught exception as torch's error file."""

POLL_S = 1.0
"""How often a running agent looks for a job-wide stop and new checkpoints."""
STOP_ACK_WAIT_S = 10.0
"""How long a stopping agent waits for the round's other agents to learn of the stop (the
c10d store lives in the first agent: it must not leave before the others read it)."""


def _when(t: float) -> str:
    return datetime.fromtimestamp(t).isoformat(timespec="seconds")


class CommittedSteps:
    """Tails ``<run_dir>/events.jsonl`` for ``checkpoint_committed`` events (rank 0's worker
    writes them): the newest committed step. In torchft mode a restarted replica group restores
    from its peers, not from a checkpoint, so ``ft_healed`` (the step it healed to) counts as
    progress too: a group that keeps healing and training is not a crash loop. So does a
    ``checkpoint_restored`` step: a job that saves to the memory tier every step and rarely to
    disk restores a step no disk commit announced; a restart that resumes further than the one
    before shows the attempt before it trained (it restarts at once, not after a growing
    backoff), one that keeps restoring the same step does not."""

    _PROGRESS = (b'"checkpoint_committed"', b'"ft_healed"', b'"checkpoint_restored"')

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / EVENTS_FILE
        self._offset = 0
        self.newest = -1

    def poll(self) -> int:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return self.newest
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self._offset += end
        for line in data[:end].splitlines():
            if not any(kind in line for kind in self._PROGRESS):
                continue
            try:
                ev = json.loads(line)
                self.newest = max(self.newest, int(ev["step"]))
            except (ValueError, KeyError, TypeError):
                continue
        return self.newest


class RecoveryPlugin(AgentPlugin):
    name = "recovery"

    def __init__(
        self,
        ctx: AgentContext,
        *,
        fencer: NodeFencer | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = ctx.config.recovery
        self.fencer = fencer or RecordOnlyFencer()
        self.clock = clock
        self.committed = CommittedSteps(ctx.run_dir)
        self._ledger: JobLedger | None = None
        self._policy: RecoveryPolicy | None = None
        self._checked_blocklist = False
        self._backoff_s = 0.0
        self._last_poll = 0.0
        self._published_step = -1
        self._store_down = False
        self.stop: dict[str, Any] | None = None
        self._hang_attempt: int | None = None
        self._drain = False
        self._started_at: float | None = None
        self._health: list[dict[str, Any]] = []
        ctx.events.subscribe(self._on_hang, [HANG_KILLED])
        ctx.events.subscribe(self._on_health, [HEALTH_UNHEALTHY])
        ctx.events.subscribe(self._on_excluded, [NODE_EXCLUDED])

    def _on_hang(self, event: dict[str, Any]) -> None:
        self._hang_attempt = event.get("attempt")

    def _on_health(self, event: dict[str, Any]) -> None:
        self._health.append(event)

    def _on_excluded(self, event: dict[str, Any]) -> None:
        # health's verdict for this node is drain (= status fail), not e.g. a straggler
        self._drain = event.get("action") == HealthAction.DRAIN

    # -- plumbing ------------------------------------------------------------------------------
    def ledger(self, ctx: AgentContext) -> JobLedger | None:
        """The job's ledger in the store that outlives rounds (the round's store for the static
        backend, which has no other)."""
        if self._ledger is None:
            store = ctx.job_store or ctx.store
            if store is None:
                return None
            self._ledger = JobLedger(store, ctx.run_id)
            self._policy = RecoveryPolicy(self.cfg, self._ledger, node=ctx.node)
        return self._ledger

    def _publish_checkpoints(self, ledger: JobLedger) -> None:
        step = self.committed.poll()
        if step > self._published_step:
            ledger.record_checkpoint(step)
            self._published_step = step

    def _emit_decision(self, ctx: AgentContext, d: RecoveryDecision, **extra: object) -> None:
        extra = {k: v for k, v in extra.items() if v is not None}
        ctx.events.emit(
            RECOVERY_DECISION,
            action=d.action.value,
            reason=d.reason,
            failed_attempt=d.attempt,
            job_restarts=d.job_restarts,
            budget=self.cfg.job_restart_budget,
            backoff_s=d.backoff_s,
            decided_by=d.decided_by,
            **extra,
        )

    def _stop_error(self, ctx: AgentContext, stop: dict[str, Any]) -> JobStopError:
        self.stop = stop
        return JobStopError(
            f"job {ctx.run_id} stopped by the recovery policy: {stop['reason']} "
            f"(decided by {stop['by']}); exit 93: do not requeue"
        )

    def _learned_stop(self, ctx: AgentContext, ledger: JobLedger) -> JobStopError | None:
        stop = ledger.stopped()
        if stop is None:
            return None
        d = RecoveryDecision(
            RecoveryAction.STOP, stop["reason"], ctx.attempt, ledger.restarts(), 0.0, stop["by"]
        )
        self._emit_decision(ctx, d, learned=True)
        return self._stop_error(ctx, stop)

    # -- eviction ------------------------------------------------------------------------------
    def evict(self, ctx: AgentContext, reason: str) -> NodeEvictedError:
        """Record this node on the blocklist, fence it, and return the error to leave with."""
        node, now = ctx.node, self.clock()
        until = now + self.cfg.eviction_cooldown_s
        ledger = self.ledger(ctx)
        if ledger is not None:
            try:
                until = ledger.block(
                    node, reason, now=now, cooldown_s=self.cfg.eviction_cooldown_s
                ).until
            except Exception as e:  # the store may be gone with its host: still leave
                logger.warning("could not record the eviction of %s in the store: %s", node, e)
        fence = self.fencer.fence(node, reason)
        ctx.events.emit(
            NODE_EVICTED,
            reason=reason,
            until=until,
            cooldown_s=self.cfg.eviction_cooldown_s,
            fencer=self.fencer.name,
            fenced=fence.fenced,
            detail=fence.detail,
        )
        return NodeEvictedError(
            f"node {node} evicted from job {ctx.run_id}: {reason}; blocklisted until "
            f"{_when(until)} (exit 94)"
        )

    def _check_blocklist(self, ctx: AgentContext, ledger: JobLedger) -> None:
        entry = ledger.blocked(ctx.node)
        if entry is None:
            return
        now = self.clock()
        if entry.active(now):
            ctx.events.emit(
                NODE_REFUSED, reason=entry.reason, evicted_at=entry.time, until=entry.until
            )
            raise NodeEvictedError(
                f"node {ctx.node} is blocklisted in job {ctx.run_id} until {_when(entry.until)} "
                f"(evicted {_when(entry.time)}: {entry.reason}); not joining: start it again "
                f"after {_when(entry.until)} (exit 94)"
            )
        ledger.unblock(ctx.node)
        ctx.events.emit(
            NODE_READMITTED, reason=entry.reason, evicted_at=entry.time, until=entry.until
        )

    # -- hooks ---------------------------------------------------------------------------------
    def worker_hooks(self, ctx: AgentContext) -> Sequence[str]:
        # [recovery] attribution: an uncaught exception is written as torch's error file in
        # the worker (the evidence failure attribution reads, without @record in the script)
        return (ERROR_FILE_HOOK,) if self.cfg.attribution else ()

    def before_rendezvous(self, ctx: AgentContext) -> None:
        ledger = self.ledger(ctx)
        if ledger is None:
            return
        if not self._checked_blocklist:
            self._checked_blocklist = True
            self._check_blocklist(ctx, ledger)
        stop = self._learned_stop(ctx, ledger)
        if stop is not None:
            raise stop
        wait, self._backoff_s = self._backoff_s, 0.0
        if wait > 0:
            logger.warning("restart backoff: waiting %.1f s before the next rendezvous", wait)
            time.sleep(wait)

    def on_workers_started(self, ctx: AgentContext, group: WorkerGroup) -> None:
        self._started_at = time.monotonic()
        self._health = []

    def on_monitor(self, ctx: AgentContext, group: WorkerGroup, result: RunResult) -> None:
        now = time.monotonic()
        if now - self._last_poll < POLL_S:
            return None
        self._last_poll = now
        ledger = self.ledger(ctx)
        if ledger is None:
            return None
        try:
            self._publish_checkpoints(ledger)
            stop = self._learned_stop(ctx, ledger)
        except Exception as e:  # the store's host is gone: the agent learns it its own way
            if not self._store_down:
                logger.warning("recovery: the rendezvous store cannot be read: %s", e)
            self._store_down = True
            return None
        self._store_down = False
        if stop is not None:
            raise stop
        return None

    def on_failure(self, ctx: AgentContext, failures: list[WorkerFailure]) -> None:
        ledger = self.ledger(ctx)
        if ledger is None or self._policy is None:
            return
        self._publish_checkpoints(ledger)
        max_nodes = getattr(ctx.launch_config, "max_nodes", 1) or 1
        hang = self._hang_attempt is not None and self._hang_attempt == max(ctx.attempt, 0)
        ran = None if self._started_at is None else time.monotonic() - self._started_at
        d = self._policy.decide(
            ctx.attempt,
            failures,
            now=self.clock(),
            evictable=int(max_nodes) > 1,
            hang=hang,
            ran_s=ran,
            world_size=ctx.world_size,
            health=list(self._health),
        )
        cause = "hang" if hang else "failure"
        attr = d.attribution
        if attr:
            ctx.events.emit(
                FAILURE_ATTRIBUTED,
                failed_attempt=d.attempt,
                cause=attr["cause"],
                verdict=attr["verdict"],
                summary=attr["summary"],
                deterministic=attr["deterministic"],
                ranks=attr["ranks"],
                evidence=attr["evidence"],
            )
        self._emit_decision(
            ctx,
            d,
            agent_restarts=ctx.agent_restarts,
            cause=cause,
            verdict=attr.get("verdict"),
            failure_cause=attr.get("cause"),
        )
        if d.action is RecoveryAction.RESTART:
            self._backoff_s = d.backoff_s
        elif d.action is RecoveryAction.STOP:
            raise self._stop_error(
                ctx, ledger.stopped() or {"reason": d.reason, "by": d.decided_by}
            )
        elif d.action is RecoveryAction.EVICT:
            raise self.evict(ctx, d.reason)

    def on_exit(
        self, ctx: AgentContext, state: str, error: BaseException | None
    ) -> BaseException | None:
        if isinstance(error, (NodeEvictedError, JobStopError)):
            return None
        if isinstance(error, NodeUnhealthyError):
            if ctx.attempt < 0 or not self.cfg.evict_on_health or not self._drain:
                # kept out before it ever joined, or excluded for another reason (a
                # straggler): it leaves (exit 1) but is not evicted
                return None
            reason = f"health: {error}"
            d = RecoveryDecision(RecoveryAction.EVICT, reason, ctx.attempt, -1, decided_by=ctx.node)
            self._emit_decision(ctx, d)
            return self.evict(ctx, reason)
        if state in (JobState.SUCCEEDED, JobState.REQUEUE) or self._ledger is None:
            return None
        try:  # e.g. the rendezvous was closed because the job stopped elsewhere
            stop = self._learned_stop(ctx, self._ledger)
        except Exception:  # the store is gone: nothing to learn
            return None
        return stop

    def on_finish(self, ctx: AgentContext, state: str) -> None:
        if state != JobStopError.state or self._ledger is None:
            return
        members = max(1, ctx.group_world_size - len(ctx.foreign_ranks))
        try:
            self._ledger.ack_stop()
            acks = self._ledger.wait_acks(members, timeout_s=STOP_ACK_WAIT_S)
        except Exception as e:
            logger.debug("stop acknowledgement: %s", e)
            return
        if acks < members:
            logger.warning("%d of %d agents acknowledged the job stop", acks, members)
