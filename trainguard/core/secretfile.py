"""Reading a secret from a file: the one reader behind every secret file trainguard takes (the
fleet's job secret, the memory tier's ``memory_secret_file``).

The checks are the same for each (a regular file, not readable by group or others, at least
``min_bytes`` once stripped; optionally never through a symlink and owned by this user); what
a failure tells the user to do is the caller's (:class:`Fixes`), so each message keeps its
meaning: a file trainguard made itself is deleted and made again, a file the user named is
created or fixed by the user.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

__all__ = ["Fixes", "read_secret_file"]


@dataclass(frozen=True, slots=True)
class Fixes:
    """What each failure's message tells the user to do (appended after ``; ``, or after the
    reason where noted)."""

    unopenable: str
    """The file cannot be opened (after the reason, e.g. ``delete it or fix its path``)."""
    not_regular: str
    owner: str
    """Owned by another user (checked only with ``own=True``)."""
    group_readable: str
    short: str
    """Shorter than ``min_bytes`` (with its own separator: ``"; delete it"``, ``" (e.g. ...)"``)."""


def read_secret_file(
    path: str | os.PathLike[str],
    *,
    where: str,
    min_bytes: int,
    fixes: Fixes,
    nofollow: bool = False,
    own: bool = False,
) -> bytes:
    """The secret in ``path``, stripped (at most 64 KiB read). ``ValueError`` with one line
    (``where``: what the file is; the reason; ``fixes``' advice) when it cannot be opened, is
    not a regular file, is owned by another user (``own``), is readable by group or others,
    or holds fewer than ``min_bytes``. ``nofollow``: a symlink at ``path`` is refused."""
    flags = os.O_RDONLY | (os.O_NOFOLLOW if nofollow else 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ValueError(f"{where}: cannot open it ({e.strerror}); {fixes.unopenable}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(_line(where, "not a regular file", fixes.not_regular))
        if own and st.st_uid != os.geteuid():
            raise ValueError(
                _line(where, f"owned by uid {st.st_uid}, not by this user", fixes.owner)
            )
        if st.st_mode & 0o077:
            raise ValueError(
                _line(
                    where,
                    f"readable by group or others (mode {stat.S_IMODE(st.st_mode):o})",
                    fixes.group_readable,
                )
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(1 << 16).strip()
    finally:
        os.close(fd)
    if len(raw) < min_bytes:
        raise ValueError(f"{where}: {len(raw)} bytes, at least {min_bytes} needed{fixes.short}")
    return raw


def _line(where: str, reason: str, fix: str) -> str:
    return f"{where}: {reason}; {fix}" if fix else f"{where}: {reason}"
