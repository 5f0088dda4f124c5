"""Files written where another principal may have placed something first (the run directory,
its debug and hang directories, a worker's error file, a report): never through a symlink.

Every such write goes through :func:`write_atomic` (or :func:`atomic_open` for a writer that
needs a file object): an exclusively created, randomly named temporary file in the target's
directory, opened without following a symlink (``O_CREAT | O_EXCL | O_NOFOLLOW``), renamed over
the target (a rename replaces a symlink planted at the target's name; it never writes through
it). An append-only file (events, metrics, stack dumps) is opened with :func:`open_append`,
which refuses a symlink. A directory another process asks this one to write into (a dump
request) is used only when :func:`owned_dir` says it is a real directory of this user.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "DEFAULT_DIR_MODE",
    "atomic_open",
    "make_dirs",
    "open_append",
    "owned_dir",
    "write_atomic",
]

DEFAULT_DIR_MODE = 0o700
"""Run and checkpoint directories are private to the job's user unless configured otherwise."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _exclusive_tmp(path: Path, mode: int) -> tuple[int, Path]:
    host = socket.gethostname().replace(os.sep, "_")[:64]
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    while True:
        tmp = path.with_name(f".{path.name}.{host}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, flags, mode), tmp
        except FileExistsError:
            continue


@contextlib.contextmanager
def atomic_open(
    path: str | os.PathLike[str], *, binary: bool = False, mode: int = 0o666
) -> Iterator[IO[Any]]:
    """A file object to write ``path``'s new content to; on a clean exit it is renamed over
    ``path`` (a reader sees the old file or the new one), on an exception it is removed.

    The temporary name carries this host's name, the pid and 64 random bits, and is created
    exclusively and without following a symlink: agents on several nodes never write into each
    other's temporary file, and a name planted in advance (a symlink to another file of this
    user) makes the open fail instead of writing through it. ``mode`` is filtered by the
    umask, as ``open`` would."""
    path = Path(path)
    fd, tmp = _exclusive_tmp(path, mode)
    try:
        f: IO[Any] = os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")
        with f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(
    path: str | os.PathLike[str], data: str | bytes | bytearray, *, mode: int = 0o666
) -> Path:
    """Write ``data`` to ``path`` through :func:`atomic_open`; returns ``path``."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    with atomic_open(path, binary=True, mode=mode) as f:
        f.write(raw)
    return path


def open_append(path: str | os.PathLike[str], mode: int = 0o644) -> int:
    """A descriptor appending to ``path`` (created when missing); raises OSError (ELOOP) when
    ``path`` is a symlink, instead of appending to whatever it points at."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC, mode)


def owned_dir(path: str | os.PathLike[str], uid: int | None = None) -> bool:
    """Whether ``path`` is a directory itself (not a symlink to one) owned by ``uid`` (default:
    this process's user): the only kind of directory a request from the run directory may make
    this process write into."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == (os.getuid() if uid is None else uid)


def make_dirs(path: str | os.PathLike[str], mode: int = DEFAULT_DIR_MODE) -> Path:
    """Create ``path`` and its missing parents with ``mode`` (exactly: not filtered by the
    umask), as ``mkdir -p -m``; an existing directory is left as it is. Raises OSError."""
    path = Path(path)
    missing: list[Path] = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=mode)
        except FileExistsError:
            continue  # another node's agent made it meanwhile
        # exactly ``mode``, on the directory just made (a symlink put in its place meanwhile
        # is refused, never followed to chmod what it points at)
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory")
    return path
