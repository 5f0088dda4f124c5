"""Async, atomic, sharded checkpoints with an in-memory tier (``tg.checkpoint``).

ckpt = tg.checkpoint
start = ckpt.restore_or_init({"model": model, "optim": opt, "data": loader_state})
for step in range(start, steps):
    ...train...
    ckpt.maybe_save(step + 1, {"model": model, "optim": opt, "data": loader_state})
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
