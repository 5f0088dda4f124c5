"""Whose answer a health probe got (the probe itself is the engine contract's one probe,
:func:`trainguard.core.contracts.engine.probe_health`).

A replica's health answer names the process that gave it: ``pid`` (its own) and
``incarnation`` (the nonce the supervisor gave that start in ``TRAINGUARD_ROLE_INCARNATION``).
An answer counts only when it comes from the process the supervisor started: another
process on the port (a squatter, or a promoted standby still on its old port) is never taken
for the replica.
"""

from __future__ import annotations

import enum
import os

from trainguard.core.contracts.engine import Probe, probe_health

__all__ = ["Probe", "Whose", "identity", "probe_health", "whose"]


class Whose(enum.Enum):
    """Whose answer a probe got, as the supervisor sees it."""

    OWN = "own"
    """The process it started (its incarnation; or, where the answer names no incarnation,
    a pid of that process's group)."""
    FOREIGN = "foreign"
    """Another process."""
    ANONYMOUS = "anonymous"
    """The answer names no process: never counted."""


def identity(p: Probe) -> str:
    """How an answer names its process, for events and messages."""
    h = p.health
    return f"pid {h.pid}, incarnation {h.incarnation}" if h is not None else "no answer"


def whose(p: Probe, pgid: int, incarnation: str) -> Whose:
    h = p.health
    if h is None:
        return Whose.ANONYMOUS
    if h.incarnation is not None:
        return Whose.OWN if h.incarnation == incarnation else Whose.FOREIGN
    if h.pid is not None:
        if h.pid == pgid:
            return Whose.OWN
        try:
            return Whose.OWN if os.getpgid(h.pid) == pgid else Whose.FOREIGN
        except OSError:  # not here (another host's pid) or gone
            return Whose.FOREIGN
    return Whose.ANONYMOUS
