"""Atomic replacement of a small file in a directory that several hosts share (the run dir)."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same directory, then rename
    it over ``path``: a reader sees the old file or the new one, never half of one.

    The temporary name carries this host's name, the pid and random bits, and is created
    exclusively (``O_EXCL``): agents on several nodes (containers often share pids, sometimes
    host names) never write into each other's temporary file. Its mode follows the umask, as
    ``open`` would make it."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    host = socket.gethostname().replace(os.sep, "_")[:64]
    while True:
        tmp = path.with_name(f".{path.name}.{host}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
