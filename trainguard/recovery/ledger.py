"""The job's recovery state in the rendezvous store: one key space per run id, shared by every
node's agent and kept across rendezvous rounds (and agent restarts).

Keys (under ``trainguard/recovery/<run id>/``):

==========================  =======================================================================
``restarts``                job-wide restarts made so far (``store.add``)
``claim/<attempt>``         the first agent to ``add`` 1 here decides for the failed attempt
``decision/<attempt>``      that decision (JSON), read by every other agent that saw the round fail
``stop``                    the job-wide stop (JSON: reason, by, time); every agent exits 93
``stop_ack``                agents that learned of the stop (the deciding one waits for them)
``ckpt_step``               the newest committed checkpoint step any agent saw (a max)
``progress``                crash-loop mark: checkpoint step and restart count when it last advanced
``blocklist/<node>``        an evicted node: reason, time, until (JSON)
``signature/<attempt>/<n>`` node ``n``'s user-code failure signature in a failed attempt
``sigranks/<attempt>/<h>``  ranks of every node that failed in the attempt with signature hash h
==========================  =======================================================================

Waits poll with ``check`` (never a blocking ``wait``/``get`` on a key that may never come): the
store client is shared with torch's rendezvous keep-alive.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from trainguard.core.storeutil import gather

__all__ = ["BlockEntry", "JobLedger", "StoreLike"]


class StoreLike(Protocol):
    """The part of ``torch.distributed.Store`` the ledger uses."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...
    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...
    def delete_key(self, key: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class BlockEntry:
    node: str
    reason: str
    time: float
    """When the node was evicted (unix seconds, the evicting agent's clock)."""
    until: float
    """When the cooldown ends."""

    def active(self, now: float) -> bool:
        return now < self.until


def _s(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class JobLedger:
    """Job-wide recovery state of run ``run_id`` in ``store``."""

    def __init__(self, store: StoreLike, run_id: str) -> None:
        self.store = store
        self.prefix = f"trainguard/recovery/{run_id}/"

    def _k(self, name: str) -> str:
        return self.prefix + name

    def _set(self, name: str, value: str) -> None:
        """Set and make it visible to the other clients before returning (a TCPStore ``set``
        is not acknowledged: the ``check`` after it on the same connection is)."""
        key = self._k(name)
        self.store.set(key, value)
        self.store.check([key])

    def _get(self, name: str) -> str | None:
        key = self._k(name)
        if not self.store.check([key]):
            return None
        return _s(self.store.get(key))

    # -- restarts and decisions --------------------------------------------------------------
    def restarts(self) -> int:
        return int(self.store.add(self._k("restarts"), 0))

    def count_restart(self) -> int:
        """Count one more job-wide restart; returns the new total."""
        return int(self.store.add(self._k("restarts"), 1))

    def claim(self, attempt: int) -> bool:
        """True for exactly one caller per failed attempt: it decides for the job."""
        return int(self.store.add(self._k(f"claim/{attempt}"), 1)) == 1

    def publish_decision(self, attempt: int, decision: dict[str, Any]) -> dict[str, Any]:
        """Set the decision for ``attempt`` unless one is there; returns the one that is."""
        raw = self.store.compare_set(self._k(f"decision/{attempt}"), "", json.dumps(decision))
        got: dict[str, Any] = json.loads(_s(raw))
        return got

    def decision(self, attempt: int, *, timeout_s: float) -> dict[str, Any] | None:
        """The decision for ``attempt`` once it is published, or None after ``timeout_s``."""
        key = self._k(f"decision/{attempt}")
        got = gather(self.store, [key], timeout_s=timeout_s, poll_s=0.05)
        return json.loads(_s(got[key])) if key in got else None

    # -- job-wide stop -------------------------------------------------------------------------
    def stop(self, reason: str, *, by: str, now: float | None = None) -> dict[str, Any]:
        """Publish the job-wide stop (the first one stays); returns the stop in force."""
        value = {"reason": reason, "by": by, "time": time.time() if now is None else now}
        got: dict[str, Any] = json.loads(
            _s(self.store.compare_set(self._k("stop"), "", json.dumps(value)))
        )
        return got

    def stopped(self) -> dict[str, Any] | None:
        raw = self._get("stop")
        return json.loads(raw) if raw else None

    def ack_stop(self) -> int:
        return int(self.store.add(self._k("stop_ack"), 1))

    def wait_acks(self, count: int, *, timeout_s: float) -> int:
        """Wait until ``count`` agents acknowledged the stop (or the timeout); returns the acks."""
        deadline = time.monotonic() + timeout_s
        while True:
            n = int(self.store.add(self._k("stop_ack"), 0))
            if n >= count or time.monotonic() >= deadline:
                return n
            time.sleep(0.05)

    # -- checkpoint progress -------------------------------------------------------------------
    def record_checkpoint(self, step: int) -> int:
        """Raise the job's newest committed checkpoint step to ``step``; returns the step now."""
        key = self._k("ckpt_step")
        current = self._get("ckpt_step")
        while True:
            if current is not None and int(current) >= step:
                return int(current)
            got = _s(self.store.compare_set(key, current or "", str(step)))
            if got == str(step):
                return step
            current = got

    def checkpoint_step(self) -> int:
        """The newest committed checkpoint step seen (-1: none)."""
        raw = self._get("ckpt_step")
        return int(raw) if raw else -1

    def progress_mark(self) -> tuple[int, int]:
        """(checkpoint step, job restarts) when the checkpoint step last advanced."""
        raw = self._get("progress")
        if not raw:
            return -1, 0
        mark = json.loads(raw)
        return int(mark["step"]), int(mark["restarts"])

    def set_progress_mark(self, step: int, restarts: int) -> None:
        self._set("progress", json.dumps({"step": step, "restarts": restarts}))

    # -- failure signatures ---------------------------------------------------------------------
    def record_signature(self, attempt: int, node: str, signature: str) -> None:
        self._set(f"signature/{attempt}/{node}", signature)

    def count_signature_ranks(self, attempt: int, signature: str, ranks: int) -> int:
        """Add ``ranks`` that failed with ``signature`` in ``attempt``; the job's total so far."""
        h = hashlib.sha1(signature.encode()).hexdigest()[:16]
        return int(self.store.add(self._k(f"sigranks/{attempt}/{h}"), ranks))

    def signature(self, attempt: int, node: str) -> str | None:
        """``node``'s user-code failure signature in ``attempt`` (None: none recorded)."""
        return self._get(f"signature/{attempt}/{node}") if attempt >= 0 else None

    # -- blocklist -----------------------------------------------------------------------------
    def block(self, node: str, reason: str, *, now: float, cooldown_s: float) -> BlockEntry:
        entry = BlockEntry(node, reason, now, now + cooldown_s)
        self._set(f"blocklist/{node}", json.dumps(asdict(entry)))
        return entry

    def blocked(self, node: str) -> BlockEntry | None:
        """The node's blocklist entry (active or expired), None when it has none."""
        raw = self._get(f"blocklist/{node}")
        return BlockEntry(**json.loads(raw)) if raw else None

    def unblock(self, node: str) -> None:
        self.store.delete_key(self._k(f"blocklist/{node}"))
