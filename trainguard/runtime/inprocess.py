"""In-process restarts, the agent's side: replace only the dead local worker.

torch's process context stops every worker as soon as one fails (``SubprocessContext._poll``).
When the workers run their training in ``trainguard.run(fn)`` (each said so in the round's
worker store: :func:`trainguard.core.inprocess.ready_key`), the agent instead looks at its
workers *before* torch does, once per monitor tick, and when some died but others live:

1. records the failure as usual (``worker_failed`` events, the plugins' ``on_failure``) and
   spends one of ``--max-restarts``;
2. starts generation ``g+1`` in the worker store (:data:`GEN_KEY`, then :func:`announce_key`):
   the survivors, whose collectives failed when the peer's sockets closed (or whose watchdog
   saw the announcement), abort their process group and wait for it;
3. starts a replacement for each dead local rank with the same environment
   (:func:`spawn_replacement`, one small function so a warm process pool can take its place)
   in the dead one's slot of torch's process context, so torch keeps monitoring it as its own.

Survivors and replacements then form generation ``g+1``'s process group under a fresh store
prefix and re-enter the function, restoring from the node's memory tier.

Not handled here (torch's normal restart of the whole group instead): function entrypoints,
more than one node, a local group with no survivor, a worker that never entered
``trainguard.run``, a worker that exited 0 or asked for a requeue, an exhausted restart
budget, and a worker that gave up on an in-process restart (:data:`FALLBACK_EXIT_CODE`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from typing import Any, Protocol

from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from trainguard.core.config import TrainGuardConfig
from trainguard.core.contracts.event_kinds import HANG_KILLED, HEALTH_UNHEALTHY
from trainguard.core.events import EventLog
from trainguard.core.failures import DO_NOT_REQUEUE_EXIT_CODE, REQUEUE_EXIT_CODE
from trainguard.core.inprocess import (
    FALLBACK_EXIT_CODE,
    GEN_KEY,
    GENERATION_ENV,
    announce_key,
    ready_key,
)
from trainguard.runtime import _torch
from trainguard.runtime.warm.pool import PooledSubprocessHandler, WarmPool

__all__ = ["InProcessRestarter", "spawn_replacement"]

logger = logging.getLogger(__name__)

_NOT_RESTARTABLE = {0, REQUEUE_EXIT_CODE, DO_NOT_REQUEUE_EXIT_CODE, FALLBACK_EXIT_CODE}

GROUP_KILL_EVENTS = frozenset({HANG_KILLED, HEALTH_UNHEALTHY})
"""Events of plugins that SIGKILL the whole local group on purpose (a hang, an unhealthy
node): the deaths that follow are a group restart, never an in-process one."""


def spawn_replacement(
    pcontext: Any, local_rank: int, extra_env: dict[str, str], *, pool: Any = None
) -> Any:
    """Start a new worker process for ``local_rank`` of torch's ``pcontext`` with the
    environment, arguments and log files torch gave the first one (plus ``extra_env``);
    returns its handler (``.warm``: it came pre-started from ``pool``, the agent's warm pool,
    else it is a cold start)."""
    env = {**pcontext.envs[local_rank], **extra_env}
    # appended to: the dead worker's output stays, and torch's tail threads keep reading it
    return PooledSubprocessHandler(
        pcontext.entrypoint,
        pcontext.args[local_rank],
        env,
        pcontext.stdouts.get(local_rank) or None,
        pcontext.stderrs.get(local_rank) or None,
        local_rank,
        pool=pool,
        mode="a",
        numa_options=_torch.numa_options_of(pcontext),
    )


class RestartingAgent(Protocol):
    """What the in-process restarter needs of its agent (``TrainGuardAgent``)."""

    tg_config: TrainGuardConfig
    events: EventLog
    remaining_restarts: int

    @property
    def pcontext(self) -> Any: ...

    @property
    def warm_pool(self) -> WarmPool | None: ...

    def report_failures(self, worker_group: WorkerGroup, result: RunResult) -> None: ...


class InProcessRestarter:
    """Owned by the agent; :meth:`check` runs at the start of every monitor tick."""

    def __init__(self, agent: RestartingAgent) -> None:
        self.agent = agent
        self.generation = 0
        """The newest in-process generation this agent started (0: none yet)."""
        self._store: TCPStore | None = None
        self._store_addr: tuple[str, int] | None = None
        self._group_killed: str | None = None
        agent.events.subscribe(self._on_group_kill, kinds=GROUP_KILL_EVENTS)

    def _on_group_kill(self, event: dict[str, Any]) -> None:
        self._group_killed = str(event.get("kind"))

    # -- the worker store ------------------------------------------------------------------------
    def _worker_store(self, group: WorkerGroup) -> TCPStore | None:
        addr = (str(group.master_addr), int(group.master_port or 0))
        if self._store is None or self._store_addr != addr:
            self._store = None
            try:
                self._store = TCPStore(
                    host_name=addr[0],
                    port=addr[1],
                    is_master=False,
                    timeout=timedelta(seconds=5),
                )
            except Exception as e:  # the round's store is gone: nothing to restart in
                logger.warning("in-process restart: worker store %s:%s unreachable: %s", *addr, e)
                return None
            self._store_addr = addr
        return self._store

    def reset(self) -> None:
        """A new rendezvous round (a normal restart): a new worker store, generation 0."""
        self.generation = 0
        self._store = None
        self._store_addr = None
        self._group_killed = None

    # -- the decision ----------------------------------------------------------------------------
    def check(self, group: WorkerGroup) -> bool:
        """Replace dead local workers in place when an in-process restart applies; True if
        it did (torch then finds every worker running)."""
        agent = self.agent
        if not agent.tg_config.inprocess.enabled:
            return False
        pc = agent.pcontext
        handlers = getattr(pc, "subprocess_handlers", None)
        if not handlers:
            return False
        codes = {lr: h.proc.poll() for lr, h in handlers.items()}
        dead = {lr: c for lr, c in codes.items() if c is not None}
        if not dead:
            return False
        why = self._not_applicable(group, codes, dead)
        if why is not None:
            logger.info("in-process restart not used: %s", why)
            return False
        store = self._worker_store(group)
        if store is None:
            return False
        ranks = [w.global_rank for w in group.workers]
        try:
            ready = store.check([ready_key(r) for r in ranks])
        except Exception as e:
            logger.warning("in-process restart: cannot read the worker store: %s", e)
            return False
        if not ready:
            logger.info("in-process restart not used: not every worker runs in trainguard.run")
            return False
        return self._restart(group, pc, store, dead)

    def _not_applicable(
        self, group: WorkerGroup, codes: dict[int, int | None], dead: dict[int, int]
    ) -> str | None:
        if self._group_killed is not None:
            return f"the group is being ended ({self._group_killed})"
        if (group.group_world_size or 1) != 1:
            return "more than one node (the group restarts)"
        if len(dead) == len(codes):
            return "no local worker survived"
        bad = sorted({c for c in dead.values() if c in _NOT_RESTARTABLE})
        if bad:
            return f"exit code(s) {bad}"
        if self.agent.remaining_restarts < 1:
            return "no restarts left (--max-restarts)"
        return None

    def _restart(self, group: WorkerGroup, pc: Any, store: TCPStore, dead: dict[int, int]) -> bool:
        agent = self.agent
        t0 = time.monotonic()
        by_local = {w.local_rank: w for w in group.workers}
        failures = {
            by_local[lr].global_rank: ProcessFailure(
                local_rank=lr,
                pid=pc.subprocess_handlers[lr].proc.pid,
                exitcode=code,
                error_file=pc.error_files[lr],
            )
            for lr, code in dead.items()
        }
        agent.report_failures(group, RunResult(state=WorkerState.FAILED, failures=failures))
        agent.remaining_restarts -= 1
        try:
            for lr in dead:  # a replacement that dies before trainguard.run: the group restarts
                store.delete_key(ready_key(by_local[lr].global_rank))
            gen = int(store.add(GEN_KEY, 1))
            store.set(
                announce_key(gen),
                json.dumps({"ranks": sorted(failures), "time": time.time()}),
            )
        except Exception as e:
            logger.warning("in-process restart: worker store failed (%s); restarting the group", e)
            return False
        self.generation = gen
        replaced = []
        for lr in sorted(dead):
            old = pc.subprocess_handlers[lr]
            try:
                err = pc.error_files[lr]
                if err and os.path.isfile(err):  # read into the failure above; the new one writes
                    os.remove(err)
                new = spawn_replacement(pc, lr, {GENERATION_ENV: str(gen)}, pool=agent.warm_pool)
            except Exception as e:  # torch's poll finds the dead worker: the group restarts
                logger.warning("in-process restart: cannot start local rank %s: %s", lr, e)
                return False
            _torch.close_logs(old)
            pc.subprocess_handlers[lr] = new
            by_local[lr].id = new.proc.pid
            replaced.append(
                {
                    "rank": by_local[lr].global_rank,
                    "local_rank": lr,
                    "old_pid": old.proc.pid,
                    "pid": new.proc.pid,
                    "exitcode": dead[lr],
                    "warm": new.warm,
                }
            )
        agent.events.emit(
            "inprocess_restart",
            generation=gen,
            replaced=replaced,
            survivors=sorted(w.global_rank for w in group.workers if w.local_rank not in dead),
            remaining_restarts=agent.remaining_restarts,
            duration_s=round(time.monotonic() - t0, 4),
        )
        return True
