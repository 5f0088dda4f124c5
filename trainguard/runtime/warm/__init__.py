"""Warm starts: each local rank's next worker process started ahead, torch already imported
(one pool, :mod:`trainguard.runtime.warm.pool`, serving restarts and a spare's first start;
kept filled by :mod:`trainguard.runtime.warm.plugin`, section ``[warm]``)."""

from __future__ import annotations

from trainguard.runtime.warm.plugin import WarmPlugin
from trainguard.runtime.warm.pool import (
    DYNAMIC_ENV,
    HOOK_DIR,
    PooledSubprocessHandler,
    WarmPool,
    WarmProcess,
    env_compatible,
    serving_torch_workers,
    warm_argv_ok,
)

__all__ = [
    "DYNAMIC_ENV",
    "HOOK_DIR",
    "PooledSubprocessHandler",
    "WarmPlugin",
    "WarmPool",
    "WarmProcess",
    "env_compatible",
    "serving_torch_workers",
    "warm_argv_ok",
]
