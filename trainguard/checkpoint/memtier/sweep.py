"""Memory tiers left behind by agents that were killed: removed when their owner lock is free
(see :mod:`trainguard.checkpoint.ownerlock`; PIDs prove nothing across PID namespaces)."""

from __future__ import annotations

import shutil
from pathlib import Path

from trainguard.checkpoint.ownerlock import LEGACY_IDLE_S, OWNER_LOCK, hold_owner_lock, orphaned

__all__ = [
    "LEGACY_IDLE_S",
    "OWNER_LOCK",
    "TIER_PREFIX",
    "hold_owner_lock",
    "orphaned",
    "remove_orphans",
]

TIER_PREFIX = "trainguard-ckpt-"
"""A tier directory is ``<memory_root>/trainguard-ckpt-<agent pid>-<random>``."""


def remove_orphans(root: Path) -> list[str]:
    """Remove the tiers under ``root`` whose agent is gone (see the module doc); their names."""
    removed = []
    for p in root.glob(f"{TIER_PREFIX}*-*"):
        if orphaned(p):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed
