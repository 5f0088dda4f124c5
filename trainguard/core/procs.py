"""Ending a node's worker processes by PID."""

from __future__ import annotations

import logging
import os
import signal

__all__ = ["kill_ranks"]

logger = logging.getLogger(__name__)


def kill_ranks(pids: dict[int, int]) -> list[int]:
    """SIGKILL each rank's process (a stopped one ignores SIGTERM); returns the ranks killed
    (a process already gone is not one of them)."""
    killed = []
    for rank, pid in sorted(pids.items()):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(rank)
        except ProcessLookupError:
            pass
        except OSError as e:
            logger.warning("cannot kill rank %d (pid %d): %s", rank, pid, e)
    return killed
