"""The agent plugin of jobs started by ``trainguard sbatch``: Slurm's node state, both ways.

- before every rendezvous (the first, and each one after a failure): a node Slurm has DRAIN,
  DOWN or FAIL (an administrator drained it mid-job, Slurm lost contact) leaves the job (event
  ``node_refused`` with its Slurm state and reason, exit 94): a spare takes its place;
- a node that was in the previous rendezvous round and is gone from the new one (its agent
  died with the node, or the node was excluded) is drained at once, not only when the job
  ends. A drain trainguard already set with its cause (the evicted node's own: ``trainguard:
  health: ... XID 79 ...``) is kept, never overwritten by the generic "node left job".

One surviving agent per lost node acts (the first to count it in the round's store); the drain
runs on a thread because the agent's hooks must stay quick.

The batch host's agent also records the scheduler's share of this allocation (event
``slurm_schedule``: queue wait, prolog, the gap since the previous allocation; from ``sacct``,
else ``scontrol show job``: :mod:`trainguard.slurm.accounting`), on a thread too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, cast

from trainguard.core.events import EventLog, read_events
from trainguard.core.fencing import NodeFencer
from trainguard.core.plugin import AgentContext, AgentPlugin, NodeEvictedError
from trainguard.core.proctime import process_start_time
from trainguard.slurm.batch import BATCH_HOST_ENV
from trainguard.slurm.cli import SlurmCli
from trainguard.slurm.fencer import REASON_PREFIX

if TYPE_CHECKING:
    from torch.distributed import Store
    from torch.distributed.elastic.agent.server.api import WorkerGroup

__all__ = ["SlurmDrainPlugin", "lost_members"]

logger = logging.getLogger(__name__)


def lost_members(previous: set[str], current: set[str]) -> list[str]:
    """Nodes of the previous round that are not in the current one."""
    return sorted(previous - current)


class SlurmDrainPlugin(AgentPlugin):
    name = "slurm_drain"

    def __init__(
        self, fencer: NodeFencer, events: EventLog, job_id: str, slurm: SlurmCli | None = None
    ) -> None:
        self.fencer = fencer
        self.events = events
        self.job_id = job_id
        self.slurm = slurm
        self._previous: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._warned = False
        self._launch = process_start_time() or time.time()
        self._scheduled = False

    def before_rendezvous(self, ctx: AgentContext) -> None:
        """Leave when Slurm says this node is not fit (DRAIN / DOWN / FAIL)."""
        if not self._scheduled:
            self._scheduled = True
            if os.environ.get(BATCH_HOST_ENV, "") == ctx.node:
                t = threading.Thread(target=self._schedule, args=(ctx.run_dir,), daemon=True,
                                     name="slurm-schedule")  # fmt: skip
                t.start()
                self._threads.append(t)
        if self.slurm is None:
            return
        try:
            infos = self.slurm.nodes([ctx.node])
        except Exception as e:  # Slurm's view is advice: never stop the job for it
            if not self._warned:
                logger.warning("cannot read node %s's Slurm state: %s", ctx.node, e)
                self._warned = True
            return
        info = next((i for i in infos if i.name == ctx.node), None)
        if info is None or not info.unusable:
            return
        reason = info.reason or "no reason given"
        ctx.events.emit(
            "node_refused", reason=f"Slurm: {info.state}: {reason}", slurm_state=info.state
        )
        raise NodeEvictedError(
            f"node {ctx.node} is {info.state.upper()} in Slurm ({reason}): left out of job "
            f"{self.job_id}; a spare takes its place (exit 94)"
        )

    def after_rendezvous(self, ctx: AgentContext, group: WorkerGroup) -> None:
        if not ctx.members:
            return
        current = {str(m.get("node")) for m in ctx.members if not m.get("foreign")}
        lost = lost_members(self._previous, current) if self._previous else []
        self._previous = current
        # torch declares WorkerGroup.store as None (it is set by the rendezvous)
        store = cast("Store | None", group.store)
        for node in lost:
            try:
                first = store is None or store.add(f"trainguard/slurm/drain/{node}", 1) == 1
            except Exception:
                first = True
            if first:
                t = threading.Thread(
                    target=self._drain, args=(node, ctx.attempt), daemon=True, name="slurm-drain"
                )
                t.start()
                self._threads.append(t)

    def _cause_set(self, node: str) -> str | None:
        """The reason of a drain trainguard already set on ``node`` with its cause."""
        if self.slurm is None:
            return None
        try:
            infos = self.slurm.nodes([node])
        except Exception:
            return None
        for i in infos:
            if i.name == node and "drain" in i.state and i.reason.startswith(REASON_PREFIX):
                if "node left job" not in i.reason:
                    return i.reason
        return None

    def _drain(self, node: str, attempt: int) -> None:
        kept = self._cause_set(node)
        if kept is not None:
            self.events.emit(
                "node_drained",
                node_name=node,
                fenced=True,
                detail=f"node {node} already drained with its cause: {kept}",
                job_id=self.job_id,
            )
            return
        res = self.fencer.fence(
            node, f"node left job {self.job_id} at attempt {attempt} (agent lost or excluded)"
        )
        self.events.emit(
            "node_drained", node_name=node, fenced=res.fenced, detail=res.detail, job_id=self.job_id
        )
        logger.warning("%s", res.detail)

    def _schedule(self, run_dir: object) -> None:
        """The ``slurm_schedule`` event of this allocation (never raises)."""
        from trainguard.slurm.accounting import schedule

        try:
            fields = schedule(self.job_id, launch=self._launch,
                              events=list(read_events(str(run_dir))))  # fmt: skip
        except Exception as e:
            fields = {
                "job_id": self.job_id,
                "source": None,
                "warnings": [f"{type(e).__name__}: {e}"],
            }
        for w in fields.get("warnings", []):
            logger.warning("scheduler times of job %s: %s", self.job_id, w)
        fields["restart"] = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        self.events.emit("slurm_schedule", **fields)

    def close(self) -> None:
        for t in self._threads:
            t.join(timeout=30)
