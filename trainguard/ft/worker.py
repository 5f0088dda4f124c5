"""The worker side of torchft mode: one ``torchft.Manager`` per replica group, DDP and optimizer
wrappers, a guard against torchft 0.2's survivor crash, and the survivor's pause as an event.

Usage (one process per replica group, started by ``trainguard run --ft``)::

    tg = trainguard.init()
    ft = tg.ft_wrap(model, optimizer)          # or trainguard.ft.wrap(model, optimizer, tg=tg)
    while ft.current_step() < steps:
        with tg.step(ft.current_step()):
            ft.optimizer.zero_grad()           # starts the quorum (may heal from a peer)
            loss = loss_fn(ft.model(x), y)
            loss.backward()                    # gradients averaged across replica groups
            ft.optimizer.step()                # applied only if every group committed
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from trainguard.core.config import load_worker_section
from trainguard.core.config.ft import FTConfig

__all__ = ["FTRun", "guarded_comm_hook", "wrap"]

logger = logging.getLogger(__name__)

REPLICA_ID_PREFIX = "trainguard_rg"


def guarded_comm_hook(manager: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """torchft's DDP comm hook without its survivor crash.

    torchft 0.2 ``DistributedDataParallel._comm_hook`` does ``work.wait()`` then
    ``assert work.get_future()._fut``. When the allreduce fails (a peer replica group died
    mid-step), ``_ManagedWork.wait()`` catches the error, reports it to the manager and returns
    False *before* ``_set_future_callback()`` has built the future chain, so ``_fut`` is None
    and the assertion kills the surviving replica. (After an earlier error in the same step
    ``allreduce`` returns a ``_DummyWork`` whose plain future has no ``_fut`` at all.)
    Here a failed allreduce yields a completed future instead: the manager holds the error, so
    ``should_commit()`` is False and the step is discarded on every replica group."""
    from torchft.manager import _ManagedFuture

    buf = bucket.buffer()
    fut: Any = None
    try:
        work = manager.allreduce(buf)
        work.wait()
        fut = work.get_future()
    except Exception as e:  # allreduce itself raised: same treatment as torchft's
        manager.report_error(e)
    if isinstance(fut, _ManagedFuture):
        inner = fut._fut
        if inner is not None:
            return inner
    elif isinstance(fut, torch.futures.Future):
        return fut  # _DummyWork's future: already completed with the (unreduced) buffer
    if manager.errored() is None:
        manager.report_error(RuntimeError("allreduce failed without a future"))
    _record_guard(manager)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buf)
    return done


# DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
guarded_comm_hook.__annotations__ = {
    "manager": Any,
    "bucket": torch.distributed.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _record_guard(manager: Any) -> None:
    count = getattr(manager, "_trainguard_guarded", 0) + 1
    manager._trainguard_guarded = count
    logger.warning("torchft allreduce failed mid-step; step discarded (guard #%d)", count)


def _replica_group() -> int:
    raw = os.environ.get("REPLICA_GROUP_ID", "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"REPLICA_GROUP_ID={raw!r} is not an integer replica group id") from None


class FTRun:
    """torchft's Manager, DDP model and optimizer wrapper for one replica group's process.

    ``model``/``optimizer`` are what the training loop uses; ``manager`` is torchft's.
    ``current_step()`` is the replica groups' shared step (it jumps when this group heals).
    Each recovery (a step that did not commit, or a change of participants) ends with an
    ``ft_recovered`` event and an ``ft_pause_s`` metric: the time from the last committed step
    before the disruption to the next committed one."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        tg: Any = None,
        state_dict: Callable[[], dict[str, Any]] | None = None,
        load_state_dict: Callable[[dict[str, Any]], None] | None = None,
        config: FTConfig | None = None,
    ) -> None:
        from torchft import Manager, ProcessGroupGloo
        from torchft.ddp import DistributedDataParallel
        from torchft.optim import OptimizerWrapper

        run_dir = Path(tg.run_dir) if tg is not None else None
        cfg = config or load_worker_section(run_dir, "ft")
        self.tg = tg
        self.replica_group = cfg.replica_group if cfg.replica_group >= 0 else _replica_group()
        self.module = model
        self._user_state_dict = state_dict
        self._user_load_state_dict = load_state_dict
        self._inner_optimizer = optimizer
        timeout = timedelta(seconds=cfg.timeout_s)
        lighthouse = cfg.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            lighthouse = f"http://127.0.0.1:{cfg.lighthouse_port}"
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            min_replica_size=cfg.min_replicas,
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            replica_id=f"{REPLICA_ID_PREFIX}{self.replica_group}",
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            lighthouse_addr=lighthouse,
        )

        class _GuardedDDP(DistributedDataParallel):
            _comm_hook = staticmethod(guarded_comm_hook)

        run = self

        class _TrackedOptimizer(OptimizerWrapper):
            def step(self, closure: object = None) -> None:
                assert closure is None, "optimizers that use closures are not supported"
                committed = self.manager.should_commit()
                if committed:
                    self.optim.step()
                run._after_step(committed)

        self.model = _GuardedDDP(self.manager, model)
        self.optimizer = _TrackedOptimizer(self.manager, optimizer)
        self._last_commit: float | None = None
        self._disrupted_since: float | None = None
        self._reasons: list[str] = []
        self._participants: int | None = None
        self.recoveries: list[dict[str, Any]] = []

    # -- healing state -------------------------------------------------------------------------
    def _state_dict(self) -> dict[str, Any]:
        if self._user_state_dict is not None:
            return self._user_state_dict()
        return {"model": self.module.state_dict(), "optim": self._inner_optimizer.state_dict()}

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        if self._user_load_state_dict is not None:
            self._user_load_state_dict(state)
        else:
            self.module.load_state_dict(state["model"])
            self._inner_optimizer.load_state_dict(state["optim"])
        if self.tg is not None:
            self.tg.events.emit("ft_healed", replica_group=self.replica_group, step=self.step)

    # -- progress ------------------------------------------------------------------------------
    def current_step(self) -> int:
        return int(self.manager.current_step())

    @property
    def step(self) -> int:
        return self.current_step()

    @property
    def guarded(self) -> int:
        """How many failed allreduces the guard turned into a discarded step (torchft 0.2 would
        have crashed on them)."""
        return int(getattr(self.manager, "_trainguard_guarded", 0))

    def _after_step(self, committed: bool) -> None:
        now = time.monotonic()
        participants = int(self.manager.num_participants())
        if not committed:
            self._disrupt("step_not_committed")
        elif self._participants is not None and participants != self._participants:
            self._disrupt("participants_lost" if participants < self._participants else "joined")
        self._participants = participants
        if not committed:
            return
        if self._disrupted_since is not None:
            pause = now - self._disrupted_since
            record = {
                "replica_group": self.replica_group,
                "pause_s": round(pause, 4),
                "reasons": self._reasons,
                "participants": participants,
                "step": self.current_step(),
                "guarded_failures": self.guarded,
            }
            self.recoveries.append(record)
            if self.tg is not None:
                self.tg.events.emit("ft_recovered", **record)
                self.tg.log(ft_pause_s=pause, ft_participants=participants)
            self._disrupted_since = None
            self._reasons = []
        self._last_commit = now

    def _disrupt(self, reason: str) -> None:
        if self._disrupted_since is None:
            self._disrupted_since = self._last_commit if self._last_commit else time.monotonic()
        if reason not in self._reasons:
            self._reasons.append(reason)

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def wrap(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    tg: Any = None,
    state_dict: Callable[[], dict[str, Any]] | None = None,
    load_state_dict: Callable[[dict[str, Any]], None] | None = None,
    config: FTConfig | None = None,
) -> FTRun:
    """Make this process one replica group member of a torchft job (see :class:`FTRun`)."""
    return FTRun(
        model,
        optimizer,
        tg=tg,
        state_dict=state_dict,
        load_state_dict=load_state_dict,
        config=config,
    )
