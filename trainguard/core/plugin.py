"""Extension points of the trainguard agent.

A plugin subclasses :class:`AgentPlugin` and overrides the hooks it needs. Hooks run in the
agent process, on the monitor thread; they must be quick (start threads for slow work) and
must not raise: the agent logs and counts a raising hook and carries on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

if TYPE_CHECKING:
    from trainguard.core.failures import WorkerFailure
    from trainguard.runtime.agent import TrainGuardAgent

__all__ = ["AgentPlugin"]


class AgentPlugin:
    """No-op base; every hook is optional."""

    name: str = "plugin"

    def before_rendezvous(self, agent: TrainGuardAgent) -> None:
        """Before this node joins a rendezvous round (preflight probes go here).

        Raise :class:`trainguard.runtime.agent.NodeUnhealthyError` to keep the node out.
        """

    def after_rendezvous(self, agent: TrainGuardAgent, group: WorkerGroup) -> None:
        """After a round completed, before workers start (e.g. cross-node probes)."""

    def on_workers_started(self, agent: TrainGuardAgent, group: WorkerGroup) -> None:
        """Right after this node's workers were spawned."""

    def on_monitor(
        self, agent: TrainGuardAgent, group: WorkerGroup, result: RunResult
    ) -> RunResult | None:
        """Every monitor tick. Return a RunResult to override the group's state
        (e.g. ``UNHEALTHY`` after a hang: the agent restarts the group, or, with no restarts
        left, the launcher reports the job failed), or ``None`` to keep it."""
        return None

    def on_failure(self, agent: TrainGuardAgent, failures: list[WorkerFailure]) -> None:
        """The group failed; ``failures`` are classified per rank."""

    def on_finish(self, agent: TrainGuardAgent, state: str) -> None:
        """The agent is done (``state`` is succeeded, failed or a signal name)."""

    def close(self) -> None:
        """Release resources; called once at the end, also on errors."""
