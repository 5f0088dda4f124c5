"""When this process started (wall time), for accounting that begins before any event."""

from __future__ import annotations

import os
import time

__all__ = ["process_start_time"]


def process_start_time(pid: int | None = None) -> float | None:
    """Unix time at which ``pid`` (default: this process) started, from ``/proc``; None where
    there is no ``/proc`` (then the caller's own first timestamp is the best there is)."""
    # starttime counts clock ticks since boot, as /proc/uptime counts seconds (to 10 ms); the
    # boot time in /proc/stat (btime) is cut to whole seconds, which would move the start by up
    # to a second
    try:
        stat = open(f"/proc/{pid or os.getpid()}/stat").read()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime, clock ticks
        now = time.time()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        start = now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
    return start if 0 < start <= time.time() + 1 else None
