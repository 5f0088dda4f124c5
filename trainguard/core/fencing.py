"""Node fencing: taking a bad node out of service outside the job (e.g. Slurm drain).

Recovery decides *that* a node is evicted; a :class:`NodeFencer` carries it out where the
cluster has a way to (the Slurm feature implements one with ``scontrol update ... state=drain``).
The default fencer only records. Fencers never raise: they return a :class:`FenceResult`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["FenceResult", "NodeFencer", "RecordOnlyFencer"]


@dataclass(frozen=True, slots=True)
class FenceResult:
    node: str
    fenced: bool
    """True when the node was actually taken out of service (drained)."""
    detail: str
    """One line for the events and the console: what was done, or why nothing was."""


@runtime_checkable
class NodeFencer(Protocol):
    name: str

    def fence(self, node: str, reason: str) -> FenceResult:
        """Take ``node`` out of service with ``reason``; never raises."""
        ...


class RecordOnlyFencer:
    """The default: nothing outside the job is changed; the eviction is only recorded."""

    name = "record"

    def fence(self, node: str, reason: str) -> FenceResult:
        return FenceResult(node, False, f"node {node} not fenced (record only): {reason}")
