"""Lifecycle events of a run: one JSON object per line in ``<run_dir>/events.jsonl``.

Every event carries ``time`` (unix seconds), ``kind``, ``node``, ``attempt`` (job-wide
worker-group attempt, 0-based) and ``restart_count`` (job-wide restarts so far). Writers from
several processes (the agent and its workers) append with ``O_APPEND`` and one ``write`` per
line, so lines never interleave.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["EventLog", "read_events"]

logger = logging.getLogger(__name__)
EVENTS_FILE = "events.jsonl"


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
        self.node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self._context = context or (lambda: {})
        self.num_write_failures = 0
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    def add_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(event)`` for every event emitted through this log (e.g. telemetry)."""
        self._listeners.append(fn)

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        event: dict[str, Any] = {"time": time.time(), "kind": kind, "node": self.node}
        try:
            event.update(self._context())
        except Exception:  # context providers must not break event emission
            logger.exception("event context provider failed")
        event.update(fields)
        line = (json.dumps(event, default=str, separators=(",", ":")) + "\n").encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as e:
            self.num_write_failures += 1
            logger.warning("could not write event %s to %s: %s", kind, self.path, e)
        for fn in self._listeners:
            try:
                fn(event)
            except Exception:
                logger.exception("event listener failed for %s", kind)
        return event


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
