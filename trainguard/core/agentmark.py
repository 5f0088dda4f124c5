"""The agent mark: a file of the run directory that every live agent of the run holds open.

A line of ``events.jsonl`` naming an agent's pid is only a claim (anyone who can write the run
directory can write any pid there, with that process's start time, which ``/proc`` shows to
everyone). Holding ``<run_dir>/agent.mark`` open is a fact about the process itself: only a
process that opened that very file has it among its descriptors, and a process outside the
job (init, a shell, another user's program) cannot be made to open it by writing the run
directory. ``trainguard chaos`` signals a process named in the events only if it holds the
mark (:func:`holds_mark`), besides its start time, owner and place in the process tree.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

__all__ = ["MARK_FILE", "hold_mark", "holds_mark", "mark_identity", "release_mark"]

logger = logging.getLogger(__name__)

MARK_FILE = "agent.mark"

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _ours(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid()


def hold_mark(run_dir: str | os.PathLike[str]) -> int | None:
    """Open (create) the run directory's agent mark and return the descriptor, to be kept
    open for the agent's life (not inherited by the workers it execs); None, with a warning,
    when it cannot be made (the agent then cannot be signalled by ``trainguard chaos``)."""
    path = Path(run_dir) / MARK_FILE
    try:
        try:
            if not _ours(os.lstat(path)):
                # a file put there by someone else (another user's, a symlink, a hard link to
                # another file): replaced by one of this agent's own
                path.unlink()
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600)
        if _ours(os.fstat(fd)):
            return fd
        os.close(fd)
        raise OSError(f"{path} is not a file of this user with one name")
    except OSError as e:
        logger.warning("no agent mark in %s (trainguard chaos will not signal this agent): %s",
                       run_dir, e)  # fmt: skip
        return None


def release_mark(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def mark_identity(run_dir: str | os.PathLike[str], owner: int) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the run directory's agent mark when it is a regular file of
    ``owner`` with one name (not a symlink, not a hard link to another file); else None."""
    try:
        st = os.lstat(Path(run_dir) / MARK_FILE)
    except OSError:
        return None
    if not (stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == owner):
        return None
    return st.st_dev, st.st_ino


def holds_mark(pid: int, mark: tuple[int, int]) -> bool:
    """Whether process ``pid`` has the file ``mark`` (:func:`mark_identity`) open (False when
    its descriptors cannot be read: another user's process)."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    for fd in fds:
        try:
            st = os.stat(f"{fd_dir}/{fd}")  # the open file itself, whatever its name now
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == mark:
            return True
    return False
