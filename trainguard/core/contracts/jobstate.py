"""How one node's run of the job ended: the ``state`` of the ``job_finished`` event.

The launcher's ``Outcome``, a plugin's ``AgentExit`` and the Slurm batch script's decision all
speak these states. Values are the strings the event log has always carried.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["JobState"]


class JobState(str, Enum):
    """How one node's agent ended (the ``job_finished`` event's ``state``).

    - ``SUCCEEDED``: every worker returned.
    - ``FAILED``: workers failed with no restarts left (or the agent itself failed).
    - ``REQUEUE``: the workers saved a preemption checkpoint; exit 75, the scheduler requeues.
    - ``DO_NOT_REQUEUE``: a worker or the recovery policy stopped the job; exit 93.
    - ``EXCLUDED``: this node left the job (preflight, straggler, health); the others go on.
    - ``EVICTED``: the recovery policy evicted this node for a cooldown (exit 94).
    - ``RENDEZVOUS_LOST``: a spare whose rendezvous store closed (the job ended without it).
    - ``SPARE_RELEASED``: a spare the job ended without (torch returned no result).
    - ``SIGTERM``, ``SIGINT``, ``SIGHUP``, ``SIGQUIT``, ``SIGUSR1``, ``SIGUSR2``: the agent was
      stopped by that signal (torch's ``SignalException``); ``SIGNALLED`` for any other.

    Compares, hashes, formats and serializes as its value (``JobState.FAILED == "failed"``).
    """

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REQUEUE = "requeue"
    DO_NOT_REQUEUE = "do_not_requeue"
    EXCLUDED = "excluded"
    EVICTED = "evicted"
    RENDEZVOUS_LOST = "rendezvous_lost"
    SPARE_RELEASED = "spare_released"
    SIGTERM = "SIGTERM"
    SIGINT = "SIGINT"
    SIGHUP = "SIGHUP"
    SIGQUIT = "SIGQUIT"
    SIGUSR1 = "SIGUSR1"
    SIGUSR2 = "SIGUSR2"
    SIGNALLED = "signalled"

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]
    __hash__ = str.__hash__

    @classmethod
    def of_signal(cls, name: str) -> JobState:
        """The state of an agent stopped by signal ``name`` (``"SIGTERM"``)."""
        try:
            return cls(name)
        except ValueError:
            return cls.SIGNALLED
