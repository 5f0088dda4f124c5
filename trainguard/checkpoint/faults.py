"""Fault injection for checkpoint tests: crash points and storage faults, set by environment.

``TRAINGUARD_TEST_CHECKPOINT_FAULT`` holds a JSON object, for example::

    {"kill_at": "before_manifest", "step": 30}     SIGKILL this process at that point
    {"kill_after_bytes": 100000, "step": 30}       SIGKILL after N bytes of the step's files
    {"enospc_after_bytes": 4096}                    writes fail with ENOSPC after N bytes

Points, in save order: ``staged``, ``persist_start``, ``written`` (this rank's files fsynced),
``before_manifest`` / ``committed`` (rank 0), ``retention`` (between removing a victim's
manifest and its files). ``step`` restricts the fault to saves of that step; ``rank`` to one rank;
``attempt`` to one attempt of a ``trainguard run`` job (``envvars.ATTEMPT``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import dataclass

from trainguard.core.contracts import envvars

__all__ = ["FAULT_ENV", "Faults"]

logger = logging.getLogger(__name__)

FAULT_ENV = envvars.CHECKPOINT_FAULT
ATTEMPT_ENV = envvars.ATTEMPT


@dataclass(kw_only=True, slots=True)
class Faults:
    kill_at: str | None = None
    kill_after_bytes: int | None = None
    enospc_after_bytes: int | None = None
    step: int | None = None
    rank: int | None = None
    attempt: int | None = None

    @classmethod
    def from_env(cls) -> Faults:
        raw = os.environ.get(FAULT_ENV)
        if not raw:
            return cls()
        try:
            return cls(**json.loads(raw))
        except (ValueError, TypeError) as e:
            logger.warning("ignoring malformed %s=%r: %s", FAULT_ENV, raw, e)
            return cls()

    def applies(self, step: int, rank: int) -> bool:
        if self.attempt is not None and self.attempt != int(os.environ.get(ATTEMPT_ENV) or 0):
            return False
        return (self.step is None or self.step == step) and (self.rank is None or self.rank == rank)

    def point(self, name: str, step: int, rank: int) -> None:
        if self.kill_at == name and self.applies(step, rank):
            logger.warning("fault injection: SIGKILL at %s (step %s)", name, step)
            os.kill(os.getpid(), signal.SIGKILL)
