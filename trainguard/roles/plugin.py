"""The agent plugin that runs the role supervisor beside the trainer's elastic agent.

The fleet starts before the first rendezvous (so before the trainer's first workers), lives
across every restart of the trainer group (the agent's rendezvous rounds call
``before_rendezvous`` again: nothing happens), and is stopped, by PID and process group, when
the agent finishes. A role failure ends the job with one line and exit code 2; the job's exit
code is otherwise the trainer's. A role below its serving ``floor`` ends it with exit code 96
(:data:`~trainguard.core.failures.ROLE_BELOW_FLOOR_EXIT_CODE`).

A role with ``nodes = K`` (``trainguard sbatch``) runs on nodes of its own
(:mod:`trainguard.roles.node`): here it only gives the workers its replicas' URLs, derived
from ``TRAINGUARD_SBATCH_ROLE_NODES``, and ends the job with the line a role node wrote to
``TRAINGUARD_SBATCH_ROLES_FAILED``. It also watches the role nodes' beacons
(:class:`~trainguard.roles.nodeloss.RoleNodeWatch`): a lost role node is drained, its replicas
re-placed on a spare node of the role, and the trainer goes on.

With ``[roles] router = true`` it also runs the fleet endpoint (:mod:`trainguard.roles.router`)
on this node, routing to the rollout engines the workers are told of, and gives its URL and
token (``TRAINGUARD_FLEET_URL``, ``TRAINGUARD_FLEET_TOKEN``) to the workers and the replicas.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

from trainguard.core.contracts import envvars
from trainguard.core.contracts.jobstate import JobState
from trainguard.core.failures import ROLE_BELOW_FLOOR_EXIT_CODE
from trainguard.core.fencing import NodeFencer
from trainguard.core.fleetauth import job_secret, role_token
from trainguard.core.plugin import AgentContext, AgentExit, AgentPlugin
from trainguard.roles.nodeloss import RoleNodeWatch
from trainguard.roles.placement import place_roles
from trainguard.roles.router import RouterProcess
from trainguard.roles.supervisor import RoleSupervisor

__all__ = ["RoleBelowFloorError", "RoleFailedError", "RolesPlugin"]

logger = logging.getLogger(__name__)


class RoleFailedError(AgentExit):
    """A role's replica cannot be kept running (restart budget spent, never ready): the job
    ends; exit code 2, as a bad argument to torchrun (the role's command or settings)."""

    exit_code = 2
    state = JobState.FAILED
    close_rendezvous = True


class RoleBelowFloorError(AgentExit):
    """A role fell below its serving ``floor`` (replicas retired, or lost with their node and
    no spare node left): the job ends with exit code 96, apart from a user error."""

    exit_code = ROLE_BELOW_FLOOR_EXIT_CODE
    state = JobState.FAILED
    close_rendezvous = True


class RolesPlugin(AgentPlugin):
    name = "roles"

    def __init__(
        self,
        ctx: AgentContext,
        env: Mapping[str, str] | None = None,
        *,
        fencer: NodeFencer | None = None,
    ) -> None:
        """``fencer``: how a lost role node is taken out of service (Slurm's drain)."""
        env = os.environ if env is None else env
        cfg = ctx.config.roles
        self.router: RouterProcess | None = None
        replica_env: dict[str, str] | None = None
        if cfg.router:
            fleet_token = role_token(job_secret(ctx.run_dir), "fleet")
            self.router = RouterProcess(cfg, ctx.run_dir, fleet_token, ctx.events.node)
            replica_env = {**os.environ, **self.router.env()}  # environments call the endpoint
        self.supervisor = RoleSupervisor(cfg, ctx.run_dir, ctx.events, env=replica_env)
        self.remote_env: dict[str, str] = {}
        """The URLs of the roles on nodes of their own."""
        self.failed_file: Path | None = None
        self.node_watch: RoleNodeWatch | None = None
        remote = [s for s in ctx.config.roles.specs() if s.nodes]
        if remote:
            # the launcher refused nodes = K outside a trainguard sbatch job
            nodes = envvars.parse_role_nodes(env.get(envvars.SBATCH_ROLE_NODES, ""))
            for role, placed in place_roles(remote, nodes).items():
                self.remote_env[envvars.ROLE_URLS[role]] = ",".join(p.url for p in placed)
            failed = env.get(envvars.SBATCH_ROLES_FAILED)
            self.failed_file = Path(failed) if failed else None
            self.node_watch = RoleNodeWatch(
                cfg, ctx.run_dir, nodes, ctx.events, fencer, job_id=env.get("SLURM_JOB_ID", "")
            )

    def worker_env(self, ctx: AgentContext) -> Mapping[str, str]:
        # the engines' URLs in the trainer's workers, fixed for the whole job (a replica
        # keeps its port across restarts)
        env = {**self.supervisor.trainer_env(), **self.remote_env}
        if self.router is not None:
            env.update(self.router.env())
        return env

    def _check(self) -> None:
        if self.supervisor.failure is not None and self.supervisor.below_floor:
            raise RoleBelowFloorError(self.supervisor.failure)
        if self.node_watch is not None and self.node_watch.failure is not None:
            raise RoleBelowFloorError(self.node_watch.failure)
        failure = self.supervisor.failure
        if failure is None and self.failed_file is not None:
            try:
                failure = self.failed_file.read_text(encoding="utf-8").strip() or None
            except OSError:  # none yet
                failure = None
        if failure is not None:
            raise RoleFailedError(failure)

    def before_rendezvous(self, ctx: AgentContext) -> None:
        self.supervisor.start()  # once: a restarted trainer group finds its engines running
        if self.node_watch is not None:
            self.node_watch.start()  # idempotent
        if self.router is not None:  # once, as the engines
            env = {**self.supervisor.trainer_env(), **self.remote_env}
            self.router.start(
                {k: env[k] for k in (envvars.ROLLOUT_URLS, envvars.ROLLOUT_TOKEN) if k in env}
            )
        self._check()

    def on_monitor(
        self, ctx: AgentContext, group: WorkerGroup, result: RunResult
    ) -> RunResult | None:
        self._check()
        if self.router is not None:
            self.router.check()
        return None

    def on_finish(self, ctx: AgentContext, state: JobState) -> None:
        self.close()

    def close(self) -> None:
        if self.node_watch is not None:
            self.node_watch.stop()
        if self.router is not None:
            self.router.stop()
        self.supervisor.stop()
