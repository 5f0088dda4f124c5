"""The vocabularies of findings and decisions that cross package lines, each spelled here once:

- :class:`HealthAction`: what the health policy does about a finding (also the values of
  ``[health]`` policy tables);
- :class:`RecoveryAction`: what the recovery policy decides about a failure (the ``action`` of
  the ``recovery_decision`` event);
- :class:`Cause`: what a failure is attributed to (the ``cause`` of ``failure_attributed``, of
  the metric ``trainguard.fleet.failures`` and of the fleet database's records);
- :class:`Verdict`: what the attribution advises for its cause (the ``verdict`` of
  ``failure_attributed``). A verdict is advice, an action is a decision: the verdicts that are
  actions (``stop``, ``evict``, ``restart``) are :class:`RecoveryAction`'s members' values, and
  :attr:`Verdict.action` is the action each verdict asks of the policy.

All serialize as their values; ``tests/test_vocabularies.py`` fails where another module
spells one of them again.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Cause", "HealthAction", "RecoveryAction", "Verdict"]


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


class Cause(str, Enum):
    """What a failed round is attributed to (:mod:`trainguard.recovery.attribution`)."""

    USER_CODE = "user_code"
    OUT_OF_MEMORY = "out_of_memory"
    HARDWARE = "hardware"
    NETWORK = "network"
    DATA = "data"
    CONTROL_PLANE = "control_plane"
    TRANSIENT = "transient"
    SDC = "sdc"
    """Silent data corruption: the replicas' check named a rank of this node."""


class Verdict(str, Enum):
    """What the attribution advises for a failure's cause."""

    STOP = RecoveryAction.STOP.value
    EVICT = RecoveryAction.EVICT.value
    RESTART = RecoveryAction.RESTART.value
    ROLLBACK = "rollback"
    """Restart from the last checkpoint (a NaN / Inf the script raised on)."""
    RETRY = "retry"
    """Restart once the control plane (rendezvous, store) answers again."""

    @property
    def action(self) -> RecoveryAction:
        """The recovery action this verdict asks for: a rollback and a retry are restarts."""
        return _VERDICT_ACTIONS.get(self, RecoveryAction.RESTART)


_VERDICT_ACTIONS = {
    v: RecoveryAction(v.value) for v in Verdict if v.value in {a.value for a in RecoveryAction}
}
