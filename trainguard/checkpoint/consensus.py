"""The ranks' collective checkpoint decisions: one small all-reduce on a control group.

Every rank calls :meth:`CheckpointManager.maybe_save` at every step boundary; what it decides
there (persist now? skip? preempted? a persister died? roll back?) must be the same on every
rank, so each rank contributes its local flags and all take the maximum. A loss rollback rides
on the same all-reduce: the smallest anomalous step any rank reports (:class:`RollbackHook`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
import torch.distributed as dist

__all__ = ["Agreement", "Consensus", "RollbackHook", "SdcHook"]

_NO_STEP = 1 << 62


class RollbackHook(Protocol):
    """What the checkpoint manager asks of a loss-rollback guard
    (:class:`trainguard.worker.rollback.LossGuard` is the one the worker handle sets)."""

    def pending(self) -> int | None:
        """This rank's anomalous step waiting for the ranks' agreement, or None."""

    def apply(self, bad_step: int, step: int, state: MutableMapping[str, Any]) -> None:
        """Roll back (collective: every rank, the same ``bad_step``) at step ``step``:
        restore into ``state`` the newest checkpoint before the anomaly."""


class SdcHook(Protocol):
    """What the checkpoint manager asks of the replicas' agreement check
    (:class:`trainguard.worker.sdc.SdcGuard` is the one the worker handle sets)."""

    @property
    def active(self) -> bool:
        """The checks run (a snapshot or persist waits for a step that passed one)."""

    def marks(self, step: int) -> dict[str, str]:
        """What a checkpoint of ``step``'s state records of the check (its manifest's
        ``extra``): ``{"sdc": "verified"}`` where a check passed at ``step``, else
        ``"unverified"`` and why."""

    def boundary(self, step: int, state: Mapping[str, object]) -> None:
        """Every step boundary (local, before the agreement): the per-step record a replay
        compares with."""

    def due(self, step: int, *, persist: bool) -> bool:
        """Whether the boundary ``step`` is checked (the same on every rank); ``persist``: a
        persisting save is agreed there."""

    def check(
        self, step: int, state: MutableMapping[str, Any], group: Any, *, forced: bool = False
    ) -> bool:
        """Compare the replicas (collective); False: they disagreed and ``state`` was rolled
        back (no save at this boundary). ``forced``: only a memory-tier snapshot asked for it
        (its cost is the snapshot's)."""


class Consensus:
    """Agreement over the control group ``pg`` (set by the manager's ``setup``); without one
    (a single process, or before ``setup``) each rank's own flags are the answer."""

    def __init__(self) -> None:
        self.pg: ProcessGroup | None = None

    def agree(self, *flags: bool) -> list[bool]:
        """Each flag: True on every rank when it is True on any rank."""
        if self.pg is None:
            return list(flags)
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return [bool(x) for x in t.tolist()]

    def agree_with_step(self, flags: list[bool], step: int | None) -> tuple[list[bool], int | None]:
        """:meth:`agree` and, in the same all-reduce, the smallest ``step`` any rank reports
        (None: no rank reports one)."""
        if self.pg is None:
            return list(flags), step
        t = torch.tensor([int(f) for f in flags] + [-(_NO_STEP if step is None else step)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        vals = [int(x) for x in t.tolist()]
        return [bool(x) for x in vals[:-1]], (None if vals[-1] == -_NO_STEP else -vals[-1])

    def start_agree_with_step(
        self, flags: list[bool], step: int | None, least: int, *, tag: Any
    ) -> Agreement:
        """:meth:`agree_with_step` plus the smallest ``least`` of any rank (a positive
        number), started now and read later (:meth:`Agreement.result`): an async all-reduce
        that runs while the caller trains on. ``tag``: what the caller agrees about; every
        rank must start and read the same agreements in the same order."""
        if self.pg is None:
            return Agreement(tag, None, (list(flags), step, least))
        t = torch.tensor([int(f) for f in flags] + [-(_NO_STEP if step is None else step), -least])
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg, async_op=True)
        return Agreement(tag, (work, t), None)

    def barrier(self) -> None:
        """Every rank reached this point (nothing without a group)."""
        if self.pg is not None:
            dist.barrier(group=self.pg)


class Agreement:
    """An agreement in flight (:meth:`Consensus.start_agree_with_step`)."""

    def __init__(
        self,
        tag: Any,
        work: tuple[Any, torch.Tensor] | None,
        done: tuple[list[bool], int | None, int] | None,
    ) -> None:
        self.tag = tag
        self._work = work
        self._done = done

    def result(self) -> tuple[list[bool], int | None, int]:
        """The agreed flags, smallest step and smallest ``least`` (waits for the all-reduce;
        local: no new collective)."""
        if self._done is None:
            assert self._work is not None
            work, t = self._work
            work.wait()
            *flags, step, least = (int(x) for x in t.tolist())
            self._done = [bool(x) for x in flags], (None if step == -_NO_STEP else -step), -least
            self._work = None
        return self._done
