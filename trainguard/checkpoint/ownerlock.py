"""Owner locks of directories in shared memory (memory tiers, private staging directories).

The owner holds an exclusive ``flock`` on the directory's ``.owner.lock`` for as long as it
runs; the kernel drops it when the owner dies, however it dies. That works across PID namespaces
(containers sharing ``/dev/shm`` see the same file), where a PID proves nothing: a PID that is
not alive in this namespace may be a live process in another one. A directory without the lock
file (made by an older version, or being created this instant) counts as orphaned only when the
PID in its name (``<prefix>-<pid>-<random>``) is gone here *and* nothing in it changed for
:data:`LEGACY_IDLE_S`.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

__all__ = ["LEGACY_IDLE_S", "OWNER_LOCK", "hold_owner_lock", "orphaned"]

OWNER_LOCK = ".owner.lock"
"""The file in a directory its owner holds an exclusive ``flock`` on while it runs."""
LEGACY_IDLE_S = 24 * 3600.0
"""How long a directory without an owner lock must have been untouched before it is removed."""


def hold_owner_lock(tier: Path) -> int:
    """Take the owner lock of ``tier`` (this process's own); the fd to keep open until the
    tier is removed (closing it releases the lock)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tier / OWNER_LOCK, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def _owner_gone(tier: Path) -> bool | None:
    """True if the tier's owner lock is free (its agent is dead), False if held, None if the
    tier has no lock file."""
    try:
        fd = os.open(tier / OWNER_LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return False  # not ours to judge (permissions)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)  # releases the probe's lock, if it got it
    return True


def _idle_since(tier: Path) -> float:
    newest = 0.0
    for dirpath, dirnames, filenames in os.walk(tier):
        for name in (dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)):
            try:
                newest = max(newest, os.lstat(name).st_mtime)
            except OSError:
                continue
    return newest


def _legacy_orphan(tier: Path) -> bool:
    try:
        pid = int(tier.name.rsplit("-", 2)[-2])
        os.kill(pid, 0)
    except (ValueError, IndexError, PermissionError):
        return False
    except ProcessLookupError:
        return time.time() - _idle_since(tier) > LEGACY_IDLE_S
    return False


def orphaned(tier: Path) -> bool:
    """Whether the directory ``tier`` (named ``<prefix><pid>-...``) lost its owner: its owner
    lock is free, or it has none, its PID is gone here and it was idle for a long time."""
    gone = _owner_gone(tier)
    return bool(gone) or (gone is None and _legacy_orphan(tier))
