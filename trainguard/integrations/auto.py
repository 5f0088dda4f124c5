"""Attach the framework integrations without a code change: installed in every worker by
``trainguard run`` (its workers' start-up hook, ``runtime/_zygote/sitecustomize.py``, when
``[integrations] auto`` is on), before the script runs.

It imports no framework. It watches for ``transformers.trainer``, ``lightning.pytorch.trainer.
trainer`` and ``pytorch_lightning.trainer.trainer`` to be imported (a ``sys.meta_path`` finder
that only wraps their loaders) and then wraps that ``Trainer.__init__`` so that every trainer
created gets trainguard's callback unless the script added one itself. Announced once per
worker on stderr (rank 0) and as an ``integration_auto_attached`` event.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["WATCHED", "install"]

logger = logging.getLogger(__name__)


def _resume() -> bool:
    """``[integrations] resume`` from the run's config.json (as every worker setting is read);
    the default where it cannot be read (never stops the script)."""
    from trainguard.core.config import worker_section_or_default
    from trainguard.core.contracts import envvars

    return bool(worker_section_or_default(os.environ.get(envvars.RUN_DIR), "integrations").resume)


def _announce(framework: str) -> None:
    try:
        import trainguard

        tg = trainguard.init()
        if tg.rank == 0:
            print(
                f"trainguard: attached to the {framework} Trainer (no code change; "
                "[integrations] auto = false to switch off)",
                file=sys.stderr,
                flush=True,
            )
            tg.events.emit("integration_auto_attached", framework=framework, resume=_resume())
    except Exception:
        logger.warning("trainguard: announcing the %s integration failed", framework, exc_info=True)


def _patch_hf(module: ModuleType) -> None:
    cls = getattr(module, "Trainer", None)
    if cls is None or getattr(cls.__init__, "_trainguard", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        try:
            from trainguard.integrations.hf import TrainGuardCallback

            if not any(isinstance(c, TrainGuardCallback) for c in self.callback_handler.callbacks):
                self.add_callback(TrainGuardCallback(resume=_resume()))
                _announce("transformers")
        except Exception:
            logger.warning("trainguard: cannot attach to transformers' Trainer", exc_info=True)

    __init__._trainguard = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def _patch_lightning(module: ModuleType) -> None:
    cls = getattr(module, "Trainer", None)
    if cls is None or getattr(cls.__init__, "_trainguard", False):
        return
    original = cls.__init__
    package = module.__name__.split(".trainer")[0]

    @functools.wraps(original)
    def __init__(self: Any, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        try:
            from trainguard.integrations.lightning import _Mixin, callback_class

            base = importlib.import_module(package).Callback
            if not any(isinstance(c, _Mixin) for c in self.callbacks):
                self.callbacks.append(callback_class(base)(resume=_resume()))
                _announce("lightning")
        except Exception:
            logger.warning("trainguard: cannot attach to Lightning's Trainer", exc_info=True)

    __init__._trainguard = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


WATCHED: dict[str, Callable[[ModuleType], None]] = {
    "transformers.trainer": _patch_hf,
    "lightning.pytorch.trainer.trainer": _patch_lightning,
    "pytorch_lightning.trainer.trainer": _patch_lightning,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, patch: Callable[[ModuleType], None]) -> None:
        self._inner, self._patch = inner, patch

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        try:
            self._patch(module)
        except Exception:
            logger.warning("trainguard: patching %s failed", module.__name__, exc_info=True)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        patch = WATCHED.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, patch)
                return spec
        return None


def install() -> None:
    """Watch for the frameworks (patch those already imported). Idempotent; never raises."""
    try:
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
        for name, patch in WATCHED.items():
            module = sys.modules.get(name)
            if module is not None:
                patch(module)
    except Exception:
        logger.warning("trainguard: installing the framework integrations failed", exc_info=True)
