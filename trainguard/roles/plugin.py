"""The agent plugin that runs the role supervisor beside the trainer's elastic agent.

The fleet starts before the first rendezvous (so before the trainer's first workers), lives
across every restart of the trainer group (the agent's rendezvous rounds call
``before_rendezvous`` again: nothing happens), and is stopped, by PID and process group, when
the agent finishes. A role failure ends the job with one line and exit code 2; the job's exit
code is otherwise the trainer's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

from trainguard.core.jobstate import JobState
from trainguard.core.plugin import AgentContext, AgentExit, AgentPlugin
from trainguard.roles.supervisor import RoleSupervisor

__all__ = ["RoleFailedError", "RolesPlugin"]

logger = logging.getLogger(__name__)


class RoleFailedError(AgentExit):
    """A role's replica cannot be kept running (restart budget spent, never ready): the job
    ends; exit code 2, as a bad argument to torchrun (the role's command or settings)."""

    exit_code = 2
    state = JobState.FAILED
    close_rendezvous = True


class RolesPlugin(AgentPlugin):
    name = "roles"

    def __init__(self, ctx: AgentContext) -> None:
        self.supervisor = RoleSupervisor(ctx.config.roles, ctx.run_dir, ctx.events)

    def worker_env(self, ctx: AgentContext) -> Mapping[str, str]:
        # the engines' URLs in the trainer's workers, fixed for the whole job (a replica
        # keeps its port across restarts)
        return self.supervisor.trainer_env()

    def _check(self) -> None:
        failure = self.supervisor.failure
        if failure is not None:
            raise RoleFailedError(failure)

    def before_rendezvous(self, ctx: AgentContext) -> None:
        self.supervisor.start()  # once: a restarted trainer group finds its engines running
        self._check()

    def on_monitor(
        self, ctx: AgentContext, group: WorkerGroup, result: RunResult
    ) -> RunResult | None:
        self._check()
        return None

    def on_finish(self, ctx: AgentContext, state: JobState) -> None:
        self.supervisor.stop()

    def close(self) -> None:
        self.supervisor.stop()
