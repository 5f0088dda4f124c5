"""The in-process restart protocol shared by the agent (``trainguard.runtime.inprocess``) and
its workers (``trainguard.worker.inprocess``).

Everything goes through the round's worker store (the TCPStore at ``MASTER_ADDR:MASTER_PORT``
that the agent hosts for the whole rendezvous round, so it outlives any one worker):

- a worker that runs its training in ``trainguard.run(fn)`` sets :func:`ready_key` for its
  rank once: the agent restarts in process only when every local rank did;
- the agent counts generations in :data:`GEN_KEY` (``store.add``; absent = generation 0) and,
  after bumping it, sets :func:`announce_key` for the new generation (what the survivors'
  watchdogs wait on);
- generation ``g``'s process group lives under the store prefix :func:`pg_prefix`, so no key
  of an aborted generation is ever read again.

A worker that cannot finish an in-process restart (the next generation never came, or never
formed) exits with :data:`FALLBACK_EXIT_CODE`: the agent then restarts the whole group the
normal way.
"""

from __future__ import annotations

from trainguard.core.contracts import envvars

__all__ = [
    "FALLBACK_EXIT_CODE",
    "GENERATION_ENV",
    "GEN_KEY",
    "announce_key",
    "pg_prefix",
    "ready_key",
]

KEY_PREFIX = "trainguard/inproc/"
GEN_KEY = KEY_PREFIX + "gen"
"""Counter of in-process generations (``store.add(GEN_KEY, 0)`` reads it; 0 when absent)."""

GENERATION_ENV = envvars.INPROCESS_GENERATION
"""Set by the agent for a replacement worker: the generation it joins."""

FALLBACK_EXIT_CODE = 76
"""A worker exits with this code when its in-process restart failed: restart the group."""


def ready_key(rank: int) -> str:
    """Set by a worker of ``rank`` once it runs its training in ``trainguard.run``."""
    return f"{KEY_PREFIX}ready/{rank}"


def announce_key(generation: int) -> str:
    """Set by the agent once generation ``generation`` exists (its JSON: ranks replaced)."""
    return f"{KEY_PREFIX}announce/{generation}"


def pg_prefix(generation: int) -> str:
    """Store prefix of generation ``generation``'s default process group."""
    return f"{KEY_PREFIX}pg/{generation}/"
