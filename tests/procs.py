"""Finding and ending the processes a test or benchmark started, by PID.

torchelastic starts every worker in a session of its own, so killing a launcher's process group
misses its workers, and a worker stopped with SIGSTOP outlives a plain SIGTERM. These helpers
walk /proc for descendants and SIGKILL each PID.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from pathlib import Path

__all__ = ["FIXTURE_PIDS", "alive", "become_subreaper", "descendants", "kill_tree"]

# PIDs a longer-lived (module- or session-scoped) fixture owns and will stop itself, although a
# test started them: e.g. etcd restarted by a fault test for the module's later tests. The
# suite's leftover check does not list these.
FIXTURE_PIDS: set[int] = set()


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return parents


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), zombies excluded."""
    parents = _parents()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out.extend(kids)
        todo.extend(kids)
    return [p for p in out if alive(p)]


def alive(pid: int) -> bool:
    """Running (or stopped): neither gone nor a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def kill_tree(proc: subprocess.Popen | int, *, wait_s: float = 30.0) -> list[int]:
    """SIGKILL ``proc`` and all its descendants by PID (stopped ones too); return the PIDs."""
    pid = proc if isinstance(proc, int) else proc.pid
    pids = [*descendants(pid), pid]
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if isinstance(proc, subprocess.Popen):
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
    return pids


def become_subreaper() -> bool:
    """Make this process adopt orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``), so a
    worker whose launcher was killed is still found by :func:`descendants`."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap() -> None:
    """Collect exited children adopted as subreaper (no zombies left behind)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
