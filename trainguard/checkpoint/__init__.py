"""Async, atomic, sharded checkpoints with an in-memory tier (``tg.checkpoint``).

ckpt = tg.checkpoint                      # local: no collective, no signal handler
state = {"model": model, "optim": opt, "data": loader_state}
ckpt.restore_or_init(state)               # collective (every rank); sets tg.step_num
while tg.step_num < steps:
    with tg.step():                       # yields the 0-based step, then counts it done
        ...train...
    ckpt.maybe_save(tg.step_num, state)   # collective; the number of steps done
ckpt.close()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["CheckpointConfig", "CheckpointManager", "SaveResult"]

if TYPE_CHECKING:
    from trainguard.checkpoint.manager import CheckpointManager, SaveResult
    from trainguard.core.config.checkpoint import CheckpointConfig


def __getattr__(name: str) -> Any:
    if name == "CheckpointConfig":
        from trainguard.core.config.checkpoint import CheckpointConfig

        return CheckpointConfig
    if name in ("CheckpointManager", "SaveResult"):
        from trainguard.checkpoint import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'trainguard.checkpoint' has no attribute {name!r}")
