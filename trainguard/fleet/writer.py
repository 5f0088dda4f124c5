"""Writes to the fleet database that never block or fail training.

:meth:`FleetWriter.put` only appends to a bounded in-memory queue; a daemon thread connects,
writes everything waiting in one batch, and disconnects (a thousand agents do not hold a
thousand connections). While the database is unreachable the records wait and the thread tries
again after ``retry_s``, doubling up to ten times that, with jitter (a thousand agents that lost
their database do not come back in step); past ``queue_max`` the oldest are dropped, counted, with one warning.
:meth:`close` waits up to ``flush_timeout_s`` for the rest.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable

from trainguard.fleet.db import FleetDB, FleetDBError, Record

__all__ = ["FleetWriter"]

logger = logging.getLogger(__name__)


class FleetWriter:
    def __init__(
        self,
        open_db: Callable[[], FleetDB],
        *,
        queue_max: int = 10000,
        retry_s: float = 2.0,
        batch: int = 500,
    ) -> None:
        self._open_db = open_db
        self.queue_max = queue_max
        self.retry_s = retry_s
        self.batch = batch
        self._queue: deque[Record] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._in_flight = 0  # records of the batch being written: they count against the bound
        self.written = 0
        self.dropped = 0
        self.errors = 0
        self.last_error: str | None = None
        self._warned_down = False
        self._failures_in_row = 0
        self._thread = threading.Thread(target=self._run, name="trainguard-fleet", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._queue) + self._in_flight

    def put(self, record: Record) -> None:
        """Queue ``record`` (never blocks, never raises)."""
        with self._cv:
            self._queue.append(record)
            while self._queue and len(self._queue) + self._in_flight > self.queue_max:
                self._queue.popleft()
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    logger.warning(
                        "fleet database: %d record(s) dropped (more than %d waiting while it is "
                        "unreachable: %s)",
                        self.dropped,
                        self.queue_max,
                        self.last_error,
                    )
            self._cv.notify()

    def _take(self) -> list[Record]:
        with self._cv:
            while not self._queue and not self._closing:
                self._cv.wait()
            out = [self._queue.popleft() for _ in range(min(self.batch, len(self._queue)))]
            self._in_flight = len(out)
            return out

    def _requeue(self, records: list[Record]) -> None:
        """Put a batch that failed back at the front; the bound holds for it too (the oldest
        go first, counted), so what waits, in the queue or in a batch being written, is never
        more than ``queue_max``."""
        with self._cv:
            self._in_flight = 0
            self._queue.extendleft(reversed(records))
            while len(self._queue) > self.queue_max:
                self._queue.popleft()
                self.dropped += 1

    def _run(self) -> None:
        db: FleetDB | None = None
        while True:
            records = self._take()
            if not records:  # closing, nothing left
                break
            try:
                if db is None:
                    db = self._open_db().connect()
                db.write(records)
                with self._cv:
                    self.written += len(records)
                    self._in_flight = 0
                    idle = not self._queue
                self._failures_in_row = 0
                if self._warned_down:
                    logger.warning("fleet database reachable again: waiting records written")
                    self._warned_down = False
                if idle and db is not None:
                    db.close()
                    db = None
            except Exception as e:
                self.errors += 1
                self.last_error = (
                    str(e) if isinstance(e, FleetDBError) else f"{type(e).__name__}: {e}"
                )
                if not self._warned_down:
                    logger.warning(
                        "fleet database: records wait (%s); trying again from %g s on",
                        self.last_error,
                        self.retry_s,
                    )
                    self._warned_down = True
                self._failures_in_row += 1
                if db is not None:
                    db.close()
                    db = None
                self._requeue(records)
                with self._cv:
                    if self._closing:
                        break
                    self._cv.wait(self._backoff())
        if db is not None:
            db.close()

    def _backoff(self) -> float:
        base = self.retry_s * 2 ** min(self._failures_in_row - 1, 10)
        return float(min(base, 10 * self.retry_s) * random.uniform(0.5, 1.5))

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued record is written (True) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while self.pending:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def close(self, timeout_s: float = 5.0) -> int:
        """Flush for up to ``timeout_s``, stop the thread; returns the records not written."""
        self.flush(timeout_s)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(max(0.5, timeout_s))
        left = self.pending
        if left:
            logger.warning(
                "fleet database: %d record(s) not written at the end of the job (%s)",
                left,
                self.last_error,
            )
        return left
