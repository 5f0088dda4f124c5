"""The agent plugin of jobs started by ``trainguard sbatch``: a node that was in the previous
rendezvous round and is gone from the new one (its agent died with the node, or the node was
excluded) is drained at once, not only when the job ends.

One surviving agent per lost node acts (the first to count it in the round's store); the drain
runs on a thread because the agent's hooks must stay quick.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, cast

from trainguard.core.events import EventLog
from trainguard.core.fencing import NodeFencer
from trainguard.core.plugin import AgentContext, AgentPlugin

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

    def __init__(self, fencer: NodeFencer, events: EventLog, job_id: str) -> None:
        self.fencer = fencer
        self.events = events
        self.job_id = job_id
        self._previous: set[str] = set()
        self._threads: list[threading.Thread] = []

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

    def _drain(self, node: str, attempt: int) -> None:
        res = self.fencer.fence(
            node, f"node left job {self.job_id} at attempt {attempt} (agent lost or excluded)"
        )
        self.events.emit(
            "node_drained", node_name=node, fenced=res.fenced, detail=res.detail, job_id=self.job_id
        )
        logger.warning("%s", res.detail)

    def close(self) -> None:
        for t in self._threads:
            t.join(timeout=30)
