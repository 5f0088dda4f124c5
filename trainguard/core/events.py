"""Lifecycle events of a run: one JSON object per line in ``<run_dir>/events.jsonl``.

Every event carries ``time`` (unix seconds), ``kind``, ``node`` and ``attempt`` (job-wide
worker-group attempt, 0-based); the agent's also carry ``agent_restarts`` (this agent's
restarts, torch's ``TORCHELASTIC_RESTART_COUNT``), the workers' their ``rank``. Writers from
several processes (the agent and its workers) append with ``O_APPEND`` and one ``write`` per
line, so lines never interleave.

The log is also the in-process bus between the agent's plugins: ``subscribe`` a listener to
some kinds (or all), ``emit`` an event (written and delivered) or ``publish`` a message that is
only delivered in this process (frequent state such as straggler scores, not worth a line in
the log). Listeners run on the emitting thread: they must be quick and must not raise.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from trainguard.core.atomicfile import make_dirs, open_append
from trainguard.core.contracts.event_kinds import LAUNCH, STRAGGLER_SCORES

__all__ = [
    "MSG_STRAGGLER_SCORES",
    "EventLog",
    "Listener",
    "launch_time",
    "node_name",
    "read_events",
]

logger = logging.getLogger(__name__)
EVENTS_FILE = "events.jsonl"

Listener = Callable[[dict[str, Any]], None]

# In-process bus messages (``EventLog.publish``; never written to the log) are registered in
# trainguard.core.contracts.event_kinds with the events, so the plugin that publishes and the one that
# listens need not know each other.
MSG_STRAGGLER_SCORES = STRAGGLER_SCORES
"""health → telemetry: ``scores`` (global rank as str → score), ``stragglers`` (ranks)."""


def node_name() -> str:
    """This node's name in the event log: Slurm's node name, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class EventLog:
    """Append-only JSONL event sink. Never raises into its caller: failures are logged and counted."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        node: str | None = None,
        context: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.node = node or node_name()
        self._context = context or (lambda: {})
        self.num_write_failures = 0
        self._listeners: list[tuple[frozenset[str] | None, Listener]] = []

    def set_context(self, context: Callable[[], dict[str, Any]]) -> None:
        """Fields every later event carries (e.g. the agent's ``attempt``)."""
        self._context = context

    def subscribe(self, fn: Listener, kinds: Iterable[str] | None = None) -> Callable[[], None]:
        """Call ``fn(event)`` for every event emitted or published here whose kind is in
        ``kinds`` (all when None). Returns the function that unsubscribes."""
        entry = (frozenset(kinds) if kinds is not None else None, fn)
        self._listeners = [*self._listeners, entry]

        def unsubscribe() -> None:
            self._listeners = [e for e in self._listeners if e is not entry]

        return unsubscribe

    def _event(self, kind: str, fields: dict[str, Any]) -> dict[str, Any]:
        event: dict[str, Any] = {"time": time.time(), "kind": kind, "node": self.node}
        try:
            event.update(self._context())
        except Exception:  # context providers must not break event emission
            logger.exception("event context provider failed")
        event.update(fields)
        return event

    def publish(self, kind: str, **fields: object) -> dict[str, Any]:
        """Deliver a message to this process's listeners only (not written to the log)."""
        event = self._event(kind, fields)
        self._deliver(event)
        return event

    def emit(self, kind: str, **fields: object) -> dict[str, Any]:
        """Append an event to the log, then deliver it to this process's listeners."""
        event = self._event(kind, fields)
        line = (json.dumps(event, default=str, separators=(",", ":")) + "\n").encode()
        try:
            make_dirs(self.path.parent)  # the run directory: private (0700) when made here
            fd = open_append(self.path)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as e:
            self.num_write_failures += 1
            logger.warning("could not write event %s to %s: %s", kind, self.path, e)
        self._deliver(event)
        return event

    def _deliver(self, event: dict[str, Any]) -> None:
        for kinds, fn in self._listeners:
            if kinds is not None and event["kind"] not in kinds:
                continue
            try:
                fn(event)
            except Exception:
                logger.exception("event listener failed for %s", event["kind"])


def read_events(run_dir: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the events of a run in file order; a torn last line is skipped."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return
    with path.open("r", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                logger.warning("skipping a malformed line in %s", path)


def launch_time(events: Iterable[Mapping[str, Any]]) -> float | None:
    """When the job started: the earliest ``launch`` event, or its launcher process's start
    (``process_start``: the interpreter and imports are wall time of the job too); None
    without a launch event."""
    starts = [
        min(float(e["time"]), float(e.get("process_start") or e["time"]))
        for e in events
        if e.get("kind") == LAUNCH
    ]
    return min(starts, default=None)
