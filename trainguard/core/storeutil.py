"""Reading other nodes' keys from a torch ``Store`` without waiting forever or blocking it.

A store client serialises its requests: a blocking ``store.wait``/``store.get`` on a key a
peer never writes (a dead peer, a torchrun agent that knows nothing of trainguard's keys)
holds the client for the whole timeout, keep-alive heartbeats of the rendezvous included.
:func:`gather` polls with ``check`` instead and returns what arrived by the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

__all__ = ["gather"]


def gather(
    store: Any, keys: Sequence[str], *, timeout_s: float, poll_s: float = 0.05
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
