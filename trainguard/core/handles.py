"""Protocols for what a component needs of the worker handle (``trainguard.init()``).

Features below the worker (the checkpoint manager, the loss guard) take the handle typed as
one of these, not as ``TrainGuard`` itself, which lives above them in the layering.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from trainguard.core.events import EventLog

__all__ = ["WorkerHandle"]


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
    def checkpoint(self) -> Any:
        """The worker's checkpoint manager."""
        ...

    def close(self) -> None: ...
