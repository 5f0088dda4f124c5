"""Process trees by PID: find a process's descendants, signal a whole tree, reap.

torchelastic starts every worker in a session of its own, so signalling a launcher's process
group misses its workers, and a worker stopped with SIGSTOP outlives a plain SIGTERM. These
helpers walk /proc for descendants and signal each PID (``trainguard chaos kill``, and every
test or benchmark ending what it started).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess

__all__ = ["alive", "become_subreaper", "descendants", "kill_tree", "lineage", "reap"]


def _stat_fields(pid: int | str) -> list[bytes]:
    """The fields of /proc/<pid>/stat after ``pid (comm)`` (comm may hold spaces and
    parentheses): state, ppid, ...; empty when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return []
    return stat[stat.rfind(b")") + 2 :].split()


def _parents() -> dict[int, int]:
    out: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            fields = _stat_fields(d)
            if len(fields) > 1:
                out[int(d)] = int(fields[1])
    return out


def alive(pid: int) -> bool:
    """Running (or stopped): neither gone nor a zombie."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] not in (b"Z", b"X")


def lineage(pid: int | None = None) -> list[int]:
    """``pid`` (default: this process) and its ancestors, up to init."""
    out: list[int] = []
    p = os.getpid() if pid is None else pid
    while p > 0 and p not in out:
        out.append(p)
        fields = _stat_fields(p)
        p = int(fields[1]) if len(fields) > 1 else 0
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), zombies excluded."""
    children: dict[int, list[int]] = {}
    for p, pp in _parents().items():
        children.setdefault(pp, []).append(p)
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return [p for p in out if alive(p)]


def kill_tree(
    proc: subprocess.Popen[bytes] | subprocess.Popen[str] | int,
    sig: int = signal.SIGKILL,
    *,
    wait_s: float = 30.0,
) -> list[int]:
    """Send ``sig`` to ``proc`` and all its descendants (found first, so none is missed once
    the parent dies; stopped ones too); returns the PIDs signalled. A ``Popen`` is waited for
    (at most ``wait_s``)."""
    pid = proc if isinstance(proc, int) else proc.pid
    done = []
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
            done.append(p)
        except (ProcessLookupError, PermissionError):
            pass
    if isinstance(proc, subprocess.Popen):
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
    return done


def become_subreaper() -> bool:
    """Make this process adopt orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``), so a
    worker whose launcher was killed is still found by :func:`descendants`."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(36, 1, 0, 0, 0) == 0)  # PR_SET_CHILD_SUBREAPER
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
