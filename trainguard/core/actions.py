"""The action vocabularies that cross package lines: what the health policy does about a finding
(:class:`HealthAction`, also the values of ``[health]`` policy tables) and what the recovery
policy decides about a failure (:class:`RecoveryAction`, also the ``action`` of the
``recovery_decision`` event). Both serialize as their values.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["HealthAction", "RecoveryAction"]


class HealthAction(str, Enum):
    """What to do about a health finding, least to most severe.

    ``IGNORE`` nothing; ``WARN`` report; ``RESTART`` restart the job's processes on this node;
    ``DRAIN`` take the node out of the job (a spare replaces it) and out of the scheduler.
    """

    IGNORE = "ignore"
    WARN = "warn"
    RESTART = "restart"
    DRAIN = "drain"

    @property
    def severity(self) -> int:
        return list(HealthAction).index(self)

    @classmethod
    def parse(cls, value: object, where: str) -> HealthAction:
        """The action ``value`` names (any case); ValueError naming ``where`` if it is none."""
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(a.value for a in cls)
            raise ValueError(f"{where}: {value!r} is not an action; use one of {names}") from None


class RecoveryAction(str, Enum):
    """What the recovery policy decided about a failure."""

    RESTART = "restart"
    """Restart every node's worker group in place (torch's restart), after ``backoff_s``."""
    EVICT = "evict"
    """This node leaves the job and is blocklisted; the others restart without it."""
    STOP = "stop"
    """The whole job stops with the "do not requeue" exit code (93)."""
    REQUEUE = "requeue"
    """The workers saved a preemption checkpoint: exit 75 so the scheduler requeues."""
