"""The memory tier's job secret: from a file the operator provides (never published), or else
created by the first agent of a rendezvous round and shared through the rendezvous store."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["MIN_SECRET_BYTES", "SECRET_KEY", "load_secret_file", "store_secret"]

SECRET_KEY = "trainguard/ckpt_memtier/secret"
"""Rendezvous-store key of the job's memory-tier secret when no secret file is set."""
MIN_SECRET_BYTES = 16
"""Shortest secret file content accepted (after stripping whitespace)."""


def load_secret_file(path: str, *, run_id: str) -> bytes:
    """The tier key derived from the secret in ``path`` and the job's ``run_id``
    (HMAC-SHA256), so one secret file serves many jobs without them accepting each other's
    snapshots. ``ValueError`` (one line: what, where, how to fix) if the file is missing,
    readable by group or others, or too short."""
    where = f"[checkpoint] memory_secret_file = {path!r}"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ValueError(
            f"{where}: cannot open it ({e.strerror}); create it or fix the path"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{where}: not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(
                f"{where}: readable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                f"chmod 600 it"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(1 << 16).strip()
    finally:
        os.close(fd)
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{where}: {len(raw)} bytes, at least {MIN_SECRET_BYTES} needed "
            f"(e.g. `head -c 32 /dev/urandom | base64 > FILE`)"
        )
    return hmac.new(raw, b"trainguard memory tier\0" + run_id.encode(), hashlib.sha256).digest()


def store_secret(store: Store) -> bytes:
    """The job's memory-tier secret shared through the rendezvous ``store``: the first agent
    to ask sets it (``compare_set``, atomic), every other one reads that value. Anyone who can
    read the store can read it; it is never logged."""
    mine = secrets.token_hex(32)
    got = store.compare_set(SECRET_KEY, "", mine)
    return bytes.fromhex(got.decode() if isinstance(got, bytes) else str(got))
