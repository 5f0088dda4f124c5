"""Reading other nodes' keys from a torch ``Store`` without waiting forever or blocking it.

A store client serialises its requests: a blocking ``store.wait``/``store.get`` on a key a
peer never writes (a dead peer, a torchrun agent that knows nothing of trainguard's keys)
holds the client for the whole timeout, keep-alive heartbeats of the rendezvous included.
:func:`gather` polls with ``check`` instead and returns what arrived by the deadline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["KeyReader", "gather", "parse_json"]

MAX_VALUE_BYTES = 1 << 20
"""The largest store value :func:`parse_json` parses (trainguard's own are under a kilobyte)."""


class KeyReader(Protocol):
    """What :func:`gather` uses of a store (``torch.distributed.Store`` has it)."""

    def check(self, keys: list[str]) -> bool: ...
    def get(self, key: str) -> bytes: ...


def gather(
    store: KeyReader, keys: Sequence[str], *, timeout_s: float, poll_s: float = 0.05
) -> dict[str, bytes]:
    """The values of ``keys`` that are set within ``timeout_s``; missing keys are left out."""
    deadline = time.monotonic() + timeout_s
    found: dict[str, bytes] = {}
    pending = list(keys)
    while True:
        still = []
        for key in pending:
            if store.check([key]):
                found[key] = store.get(key)
            else:
                still.append(key)
        pending = still
        if not pending or time.monotonic() >= deadline:
            return found
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def parse_json(raw: bytes | str, *, max_bytes: int = MAX_VALUE_BYTES) -> Any:
    """A JSON value another node put in the store, or None for anything else (over
    ``max_bytes``, not UTF-8, not JSON, nested past the parser's limit): with an etcd
    rendezvous the store lives under the run's key prefix, which anyone who may write the
    prefix can write."""
    if len(raw) > max_bytes:
        return None
    try:
        return json.loads(raw)
    except Exception:  # ValueError, UnicodeDecodeError, RecursionError...
        return None
