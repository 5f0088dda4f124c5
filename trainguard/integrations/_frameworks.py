"""The framework internals the integrations reach into, named in one place and guarded.

:data:`PRIVATES` lists every non-public name of transformers / Lightning the callbacks use
(``(module, class, attribute)``); ``tests/test_framework_privates.py`` checks each one against
the installed versions. :data:`TESTED` is the range of each framework the integrations are
tested on: :func:`check_version` warns once at attach outside it (the callback still attaches
what it can). :func:`guarded` runs one use of an internal: an error becomes one warning and an
``integration_degraded`` event, and the caller goes on with ``resume`` off; it never reaches
the training loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import TypeVar

from trainguard.core.handles import WorkerHandle

__all__ = ["PRIVATES", "TESTED", "check_version", "guarded"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

PRIVATES: tuple[tuple[str, str, str], ...] = (
    # transformers: the per-step batch fetch the HF callback wraps (skip restored steps'
    # batches, count tokens)
    ("transformers", "Trainer", "get_batch_samples"),
    # Lightning: the loop counters a restore from trainguard's snapshot moves on
    ("lightning.pytorch.loops.fit_loop", "_FitLoop", "epoch_loop"),
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop", "batch_progress"),
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop", "scheduler_progress"),
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop", "automatic_optimization"),
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop", "_batches_that_stepped"),
    ("lightning.pytorch.loops.optimization.automatic", "_AutomaticOptimization", "optim_progress"),
)
"""Every non-public name of a framework the integrations use: (module, class, attribute)."""

TESTED: dict[str, tuple[str, tuple[int, int], tuple[int, int]]] = {
    "transformers": ("transformers", (5, 0), (5, 23)),
    "lightning": ("lightning", (2, 4), (2, 6)),
}
"""framework → (distribution, oldest, newest major.minor the integrations are tested on)."""

_warned: set[str] = set()


def check_version(framework: str) -> str | None:
    """One warning (per process) when the installed framework is outside :data:`TESTED`;
    returns its version (None when unknown)."""
    dist, lo, hi = TESTED[framework]
    try:
        found = version(dist)
    except PackageNotFoundError:
        if dist == "lightning":  # the standalone pytorch_lightning distribution
            try:
                found = version("pytorch_lightning")
            except PackageNotFoundError:
                return None
        else:
            return None
    try:
        major_minor = tuple(int(x) for x in found.split(".")[:2])
    except ValueError:
        return found
    if not lo <= major_minor <= hi and framework not in _warned:
        _warned.add(framework)
        logger.warning(
            "trainguard: %s %s is outside the versions the integration is tested on "
            "(%d.%d to %d.%d): it attaches, and turns resume off if an internal it uses changed",
            framework, found, *lo, *hi,
        )  # fmt: skip
    return found


def guarded(
    tg: WorkerHandle | None, framework: str, what: str, fn: Callable[[], T]
) -> tuple[bool, T | None]:
    """``(True, fn())``, or ``(False, None)`` after one warning and an
    ``integration_degraded`` event (rank 0) when ``fn`` raised: the caller turns resume off."""
    try:
        return True, fn()
    except Exception as err:
        logger.warning(
            "trainguard: %s integration: %s failed (%s: %s); training goes on with resume off",
            framework, what, type(err).__name__, err,
        )  # fmt: skip
        try:
            if tg is not None and tg.rank == 0:
                tg.events.emit(
                    "integration_degraded",
                    framework=framework,
                    what=what,
                    error=f"{type(err).__name__}: {err}",
                    version=check_version(framework),
                )
        except Exception:  # an event is never worth stopping training for
            logger.debug("integration_degraded event not written", exc_info=True)
        return False, None
