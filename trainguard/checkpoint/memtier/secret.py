"""The memory tier's job secret: from a file the operator provides (never published), or else
created by the first agent of a rendezvous round and shared through the rendezvous store."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import TYPE_CHECKING

from trainguard.core.secretfile import Fixes, read_secret_file

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["MIN_SECRET_BYTES", "SECRET_KEY", "load_secret_file", "store_secret"]

SECRET_KEY = "trainguard/ckpt_memtier/secret"
"""Rendezvous-store key of the job's memory-tier secret when no secret file is set."""
MIN_SECRET_BYTES = 16
"""Shortest secret file content accepted (after stripping whitespace)."""


_FIXES = Fixes(
    unopenable="create it or fix the path",
    not_regular="",
    owner="",
    group_readable="chmod 600 it",
    short=" (e.g. `head -c 32 /dev/urandom | base64 > FILE`)",
)
"""The user's own file (it may be a symlink, a mounted secret's): the user creates or fixes it."""


def load_secret_file(path: str, *, run_id: str) -> bytes:
    """The tier key derived from the secret in ``path`` and the job's ``run_id``
    (HMAC-SHA256), so one secret file serves many jobs without them accepting each other's
    snapshots. ``ValueError`` (one line: what, where, how to fix) if the file is missing,
    readable by group or others, or too short."""
    raw = read_secret_file(
        path,
        where=f"[checkpoint] memory_secret_file = {path!r}",
        min_bytes=MIN_SECRET_BYTES,
        fixes=_FIXES,
    )
    return hmac.new(raw, b"trainguard memory tier\0" + run_id.encode(), hashlib.sha256).digest()


def store_secret(store: Store) -> bytes:
    """The job's memory-tier secret shared through the rendezvous ``store``: the first agent
    to ask sets it (``compare_set``, atomic), every other one reads that value. Anyone who can
    read the store can read it; it is never logged."""
    mine = secrets.token_hex(32)
    got = store.compare_set(SECRET_KEY, "", mine)
    return bytes.fromhex(got.decode() if isinstance(got, bytes) else str(got))
