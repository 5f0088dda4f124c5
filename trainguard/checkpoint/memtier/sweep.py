"""Memory tiers left behind by agents that were killed (their pid is gone)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["TIER_PREFIX", "remove_orphans"]

TIER_PREFIX = "trainguard-ckpt-"
"""A tier directory is ``<memory_root>/trainguard-ckpt-<agent pid>-<random>``."""


def remove_orphans(root: Path) -> list[str]:
    """Remove the tiers under ``root`` whose agent is gone; returns their names."""
    removed = []
    for p in root.glob(f"{TIER_PREFIX}*-*"):
        try:
            pid = int(p.name.split("-")[2])
            os.kill(pid, 0)
        except (ValueError, IndexError):
            continue
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
        except PermissionError:
            continue
    return removed
