"""trainguard: a fault-tolerant training runtime for PyTorch.

``import trainguard`` is cheap: torch, exporters, GPU and Slurm libraries load only when used.

    tg = trainguard.init()
    for batch in data:
        with tg.step(tokens=n):
            ...
        tg.log(loss=loss)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainguard.core.version import __version__

__all__ = [
    "RestartRequested",
    "TrainGuard",
    "__version__",
    "destroy_process_group",
    "init",
    "restartable",
    "run",
]

if TYPE_CHECKING:
    from trainguard.worker.api import TrainGuard, init
    from trainguard.worker.inprocess import RestartRequested, restartable, run
    from trainguard.worker.teardown import destroy_process_group


def __getattr__(name: str) -> Any:
    if name in ("init", "TrainGuard"):
        from trainguard.worker import api as worker

        return getattr(worker, name)
    if name == "destroy_process_group":
        from trainguard.worker import teardown

        return teardown.destroy_process_group
    if name in ("run", "restartable", "RestartRequested"):
        from trainguard.worker import inprocess

        return getattr(inprocess, name)
    raise AttributeError(f"module 'trainguard' has no attribute {name!r}")
