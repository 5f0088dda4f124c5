"""Protocols for what a component needs of the worker handle (``trainguard.init()``).

Features below the worker (the checkpoint manager, the loss guard) take the handle typed as
one of these, not as ``TrainGuard`` itself, which lives above them in the layering.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from trainguard.core.events import EventLog

__all__ = ["CheckpointHandle", "WorkerHandle"]


class CheckpointHandle(Protocol):
    """What the worker's other components (the loss guard, the framework integrations) use of
    ``tg.checkpoint`` (``trainguard.checkpoint.CheckpointManager``, which documents each)."""

    preempted: bool
    """The preemption save ran (``maybe_save(..., exit_on_preemption=False)``)."""

    def setup(self) -> None: ...

    def maybe_save(
        self,
        step: int,
        state: MutableMapping[str, Any],
        *,
        overlap: bool = False,
        exit_on_preemption: bool = True,
    ) -> object: ...

    def preemption_agreed(self, step: int | None = None) -> bool: ...

    def settle_agreement(self) -> None: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def restore(
        self,
        state: MutableMapping[str, Any],
        *,
        use_memory: bool = True,
        max_step: int | None = None,
        min_step: int | None = None,
    ) -> int | None: ...

    def discard_snapshots_after(self, step: int) -> None: ...

    def record_step_overhead(self, seconds: float) -> None: ...


@runtime_checkable
class WorkerHandle(Protocol):
    """The worker handle as its components see it (``trainguard.worker.api.TrainGuard``)."""

    rank: int
    world_size: int
    run_dir: Path
    events: EventLog
    step_num: int
    in_process: bool
    """The workers run in ``trainguard.run`` (in-process restarts)."""

    def log(self, *, step: int | None = None, **metrics: float | int | str) -> None:
        """Record metric values (``tg.log``)."""
        ...

    @property
    def checkpoint(self) -> CheckpointHandle:
        """The worker's checkpoint manager."""
        ...

    def close(self) -> None: ...
