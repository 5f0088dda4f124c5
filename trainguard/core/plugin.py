"""Extension points of the trainguard agent.

A plugin subclasses :class:`AgentPlugin` and overrides the hooks it needs. Every hook gets the
node's :class:`AgentContext`: the config, the torchrun launch config, the run directory, the
event log (with its in-process bus), the node name and, once a round completed, the attempt,
the rendezvous store and endpoint, and the local workers' progress. Plugins never see the
agent itself and never talk to each other directly: what one tells another goes through the
event bus (``ctx.events.publish`` / ``ctx.events.subscribe``).

Hooks run in the agent process, on the monitor thread; they must be quick (start threads for
slow work) and must not raise: the agent logs and counts a raising hook and carries on. The
one exception is :class:`AgentExit` (:class:`NodeUnhealthyError`, :class:`NodeEvictedError`,
:class:`JobStopError`), which ends this node's agent with its exit code and one line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.core.contracts.jobstate import JobState
from trainguard.core.failures import DO_NOT_REQUEUE_EXIT_CODE, EVICTED_EXIT_CODE

if TYPE_CHECKING:
    from torch.distributed import Store
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

    from trainguard.core.config import TrainGuardConfig
    from trainguard.core.events import EventLog
    from trainguard.core.failures import WorkerFailure
    from trainguard.core.progress import ProgressSnapshot

__all__ = [
    "AgentContext",
    "AgentExit",
    "AgentPlugin",
    "JobStopError",
    "NodeEvictedError",
    "NodeUnhealthyError",
    "WorkerHooksPlugin",
]


class AgentExit(RuntimeError):
    """Raised by a plugin hook to end this node's agent: ``trainguard run`` prints the message
    as one line (no traceback) and exits with ``exit_code``; ``state`` is the ``job_finished``
    state: ``FAILED`` here, ``EXCLUDED``, ``EVICTED`` or ``DO_NOT_REQUEUE`` in the subclasses. The agent stops its workers first."""

    exit_code: int = 1
    state: JobState = JobState.FAILED
    close_rendezvous: bool = False
    """True when the whole job ends (waiting spares are released); False when only this node
    leaves and the others go on."""


class NodeUnhealthyError(AgentExit):
    """Raised by a plugin (preflight, straggler exclusion) to take this node out of the job."""

    state = JobState.EXCLUDED


class NodeEvictedError(NodeUnhealthyError):
    """The recovery policy evicted this node (exit code 94, ``EVICTED_EXIT_CODE``): it leaves,
    is blocklisted for the cooldown, and the job goes on without it."""

    exit_code = EVICTED_EXIT_CODE
    state = JobState.EVICTED


class JobStopError(AgentExit):
    """The recovery policy stopped the whole job (restart budget spent, crash loop, a
    configuration error): every agent exits with 93 (``DO_NOT_REQUEUE_EXIT_CODE``)."""

    exit_code = DO_NOT_REQUEUE_EXIT_CODE
    state = JobState.DO_NOT_REQUEUE
    close_rendezvous = True


def _no_progress() -> dict[int, ProgressSnapshot]:
    return {}


@dataclass(eq=False)
class AgentContext:
    """Everything a plugin may know about its node's agent. Built by the launcher before the
    plugins, kept current by the agent (``attempt``, ``store``, ``master_*``, ``group_*``)."""

    config: TrainGuardConfig
    """The resolved trainguard config (all sections)."""
    run_dir: Path
    events: EventLog
    """The run's event log; also the in-process bus between plugins."""
    launch_config: Any = None
    """torchrun's ``LaunchConfig`` (``run_id``, ``rdzv_endpoint``, ``nproc_per_node`` ...);
    None in unit tests."""
    attempt: int = -1
    """Job-wide worker-group attempt (0-based) of the current round; -1 before the first."""
    agent_restarts: int = 0
    """This agent's restarts so far (torch's per-agent ``TORCHELASTIC_RESTART_COUNT``)."""
    store: Store | None = None
    """The rendezvous store of the current round (shared by every node's agent)."""
    job_store: Store | None = None
    """The rendezvous backend's store, which outlives the rounds (c10d: the TCPStore at the
    rendezvous endpoint; etcd-v3: the etcd key space of the run); available before the first
    round. None for the static backend. Keys here are job-wide: prefix them with the run id."""
    group_rank: int = 0
    group_world_size: int = 1
    world_size: int = 0
    """Worker ranks of the job in the current round (0 before its workers start)."""
    members: list[dict[str, Any]] = field(default_factory=list)
    """One entry per group rank of the current round: node, host, pid (``{"foreign": True}``
    for a rank whose agent is not trainguard's)."""
    foreign_ranks: list[int] = field(default_factory=list)
    """Group ranks of this round whose agent is not trainguard's (a torchrun agent in the same
    rendezvous): never wait for their keys in the store."""
    master_addr: str | None = None
    master_port: int | None = None
    worker_progress: Callable[[], dict[int, ProgressSnapshot]] = field(default=_no_progress)
    """Latest progress of every local worker, by global rank."""
    worker_pids: Callable[[], dict[int, int]] = field(default=dict)
    """Pids of this node's running workers, by global rank."""
    worker_argv: tuple[str, ...] = ()
    """The command line torch starts each local worker with (``python -u script.py args...``,
    torch's ``${local_rank}`` macro not yet substituted); empty for a function entrypoint."""
    warm_pool: Any = None
    """The pool of pre-started worker processes the agent starts its workers through
    (:class:`trainguard.runtime.warm.WarmPool`, set by its plugin); None: every start is cold."""

    @property
    def node(self) -> str:
        return self.events.node

    @property
    def run_id(self) -> str:
        """torchrun's ``--rdzv-id`` (the job id every node shares), else the run dir's name."""
        rid = getattr(self.launch_config, "run_id", None)
        return str(rid) if rid and rid != "none" else self.run_dir.name

    @property
    def rdzv_endpoint(self) -> str:
        """The rendezvous endpoint (``host:port``) the nodes meet at; empty when none."""
        return str(getattr(self.launch_config, "rdzv_endpoint", "") or "")


class AgentPlugin:
    """No-op base; every hook is optional."""

    name: str = "plugin"

    def before_rendezvous(self, ctx: AgentContext) -> None:
        """Before this node joins a rendezvous round (preflight probes go here).

        Raise :class:`NodeUnhealthyError` to keep the node out.
        """

    def after_rendezvous(self, ctx: AgentContext, group: WorkerGroup) -> None:
        """After a round completed, before workers start (e.g. cross-node probes)."""

    def on_workers_started(self, ctx: AgentContext, group: WorkerGroup) -> None:
        """Right after this node's workers were spawned."""

    def worker_env(self, ctx: AgentContext) -> Mapping[str, str]:
        """Variables this plugin's feature needs in every local worker's environment, asked
        before each start of the workers: names from :mod:`trainguard.core.contracts.envvars` only (a
        worker's environment is torchrun's plus those). A name declared for one start and not
        the next is removed."""
        return {}

    def worker_hooks(self, ctx: AgentContext) -> Sequence[str]:
        """``module:function`` entries each local worker calls at start-up, before the script
        (:mod:`trainguard.runtime.workerhook`), asked before each start of the workers. They run
        in workers started as ``python script.py`` / ``python -m module`` (not ``--no-python``
        programs): a feature that needs them degrades without them. An entry must be quick and
        must not raise (one that does is reported in one line and skipped)."""
        return ()

    def on_monitor(
        self, ctx: AgentContext, group: WorkerGroup, result: RunResult
    ) -> RunResult | None:
        """Every monitor tick. Return a RunResult to override the group's state
        (e.g. ``UNHEALTHY`` after a hang: the agent restarts the group, or, with no restarts
        left, the launcher reports the job failed), or ``None`` to keep it."""
        return None

    def on_failure(self, ctx: AgentContext, failures: list[WorkerFailure]) -> None:
        """The group failed; ``failures`` are classified per rank."""

    def on_exit(
        self, ctx: AgentContext, state: JobState, error: BaseException | None
    ) -> BaseException | None:
        """The agent stopped with ``state`` (``error``: what ``trainguard run`` would raise).
        Return an :class:`AgentExit` to end with instead (recovery turns a health exclusion
        into an eviction, a rendezvous closed by a job-wide stop into that stop), or None.
        Called before ``on_finish``; the first plugin that returns one wins."""
        return None

    def on_finish(self, ctx: AgentContext, state: JobState) -> None:
        """The agent is done (``state``: how it ended, see :class:`JobState`)."""

    def close(self) -> None:
        """Release resources; called once at the end, also on errors."""


class WorkerHooksPlugin(AgentPlugin):
    """A plugin whose feature lives in the workers only: it declares their start-up hook
    entries (e.g. ``[integrations] auto``) and does nothing in the agent."""

    def __init__(self, name: str, *entries: str) -> None:
        self.name = name
        self.entries = tuple(entries)

    def worker_hooks(self, ctx: AgentContext) -> Sequence[str]:
        return self.entries
