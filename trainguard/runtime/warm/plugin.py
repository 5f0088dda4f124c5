"""The agent's warm pool (``[warm]``): one zygote per local rank, for restarts and for spares.

After each start of the local workers the pool starts, ``[warm] prestart_delay_s`` later, one
zygote per local rank with that worker's command line and environment: the next restart (a
failure, a membership change, an in-process replacement) hands each new worker to its zygote.
A node's first start is warm too: the agent starts its zygotes as it starts (from the worker
command line and its own environment), so that the interpreters' start-up and ``import torch``
run while the agent sets up and joins the rendezvous; a zygote handed its job before its
preload is done stops preloading. A node that waits as a spare (event ``spare_waiting``) starts
them again if the first ones are gone, so the workers it starts when it takes a dead node's
slot come warm.

A thread keeps the pool filled (the agent's monitor loop does not run while a spare waits in
the rendezvous), while a restart can still follow (:func:`restart_possible`), and emits
``warm_ready`` for each zygote that finished its imports.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.elastic.utils import macros

from trainguard.core.contracts import envvars
from trainguard.core.contracts.event_kinds import SPARE_WAITING, WARM_READY
from trainguard.core.plugin import AgentContext, AgentPlugin
from trainguard.runtime.warm.pool import WarmPool

__all__ = ["WarmPlugin", "restart_possible"]

logger = logging.getLogger(__name__)

GC_HOLD_HOOK = "trainguard.core.procs:hold_gc_in_worker"
"""The worker start-up hook entry of ``[warm] setup_gc_hold_s``."""

TICK_S = 0.2
"""How often the pool is refilled and checked for ready zygotes."""


def restart_possible(ctx: AgentContext) -> bool:
    """Whether the local workers can still be restarted: restarts left (torchrun's
    ``--max-restarts`` less this agent's restarts so far), or more than one node (a membership
    change restarts them without using one; a spare's first start too). Warm processes are
    started only then: one that can never serve would import torch for nothing (a
    ``--max-restarts 0`` job on one node, torchrun's default, or one whose last restart is
    used)."""
    launch = ctx.launch_config
    if launch is None:
        return True
    if int(getattr(launch, "max_nodes", 1) or 1) > 1:
        return True
    return int(getattr(launch, "max_restarts", 0) or 0) - ctx.agent_restarts > 0


class WarmPlugin(AgentPlugin):
    """Owns the node's :class:`WarmPool` (``ctx.warm_pool``, which the agent starts its
    workers through) and keeps it filled."""

    name = "warm"

    def __init__(self, ctx: AgentContext) -> None:
        cfg = ctx.config.warm
        self.ctx = ctx
        self.pool = WarmPool(preload=tuple(cfg.preload), prestart_delay_s=cfg.prestart_delay_s)
        ctx.warm_pool = self.pool
        self._argv = tuple(ctx.worker_argv)
        self._nproc = int(getattr(ctx.launch_config, "nproc_per_node", 0) or 0)
        self._stop = threading.Event()
        self._unsubscribe = ctx.events.subscribe(self._spare_waiting, [SPARE_WAITING])
        self._prestart()  # the first start's
        self.pool.tick()  # now: the monitor thread's first tick is TICK_S away
        self._thread = threading.Thread(target=self._keep_filled, name="tg-warm", daemon=True)
        self._thread.start()

    def worker_hooks(self, ctx: AgentContext) -> Sequence[str]:
        """Warm or cold, a worker sets up with the cyclic collector held off (``[warm]
        setup_gc_hold_s``)."""
        return (GC_HOLD_HOOK,) if ctx.config.warm.setup_gc_hold_s > 0 else ()

    def worker_env(self, ctx: AgentContext) -> Mapping[str, str]:
        hold_s = ctx.config.warm.setup_gc_hold_s
        return {envvars.GC_HOLD_S: repr(float(hold_s))} if hold_s > 0 else {}

    def _spare_waiting(self, _event: dict[str, Any]) -> None:
        """This node waits as a spare: start its workers' zygotes now (unless they run)."""
        self._prestart()

    def _prestart(self) -> None:
        if not self._argv or self._nproc < 1:
            return
        env = dict(os.environ)
        due = [
            lr
            for lr in range(self._nproc)
            if self.pool.prestart(macros.substitute(list(self._argv), str(lr)), env, key=lr)
        ]
        if due:
            logger.debug("starting warm processes for local ranks %s", due)

    def _keep_filled(self) -> None:
        while not self._stop.wait(TICK_S):
            if not restart_possible(self.ctx):
                continue
            try:
                for local_rank in self.pool.tick():
                    pid = self.pool.ready().get(local_rank)
                    self.ctx.events.emit(WARM_READY, local_rank=local_rank, pid=pid)
            except Exception:  # never let the pool take the agent down
                logger.exception("warm pool")

    def close(self) -> None:
        """Stop filling and kill the unused zygotes by PID (the workers are torch's to stop)."""
        self._unsubscribe()
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.pool.close()
        if self.ctx.warm_pool is self.pool:
            self.ctx.warm_pool = None
