"""The agents' watch over the batch host of a ``trainguard sbatch`` job.

The batch shell advances a counter in ``$RUN_DIR/batch-<job id>.alive`` every second (the batch
beacon, see trainguard.slurm.batch). Every agent on another node reads it every
``poll_s`` and judges, on its own clock, how long the value has stood still (no clock is shared
between nodes). After ``[slurm] batch_dead_after_s`` of silence the batch host is lost:
:func:`trainguard.slurm.finish.take_over` runs (one agent of the job acts).

A beacon that was never seen is not judged: a job whose batch shell never wrote one (an older
batch script) is left alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["BatchBeaconWatch"]

logger = logging.getLogger(__name__)


class BatchBeaconWatch:
    """Reads the batch beacon from a daemon thread; calls ``on_lost`` once when it stood still
    for ``dead_after_s``."""

    def __init__(
        self,
        path: str,
        dead_after_s: float,
        on_lost: Callable[[float], object],
        *,
        poll_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.dead_after_s = dead_after_s
        self._on_lost = on_lost
        self._poll_s = poll_s
        self._clock = clock
        self._value: str | None = None
        self._changed: float | None = None
        self._last_read: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fired = threading.Event()

    def _read(self) -> str | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return None

    def silent_for(self) -> float | None:
        """One read: how long the beacon has stood still as seen from here (None: never seen
        yet, or it moved just now)."""
        now = self._clock()
        if self._last_read is not None and now - self._last_read > self.dead_after_s / 2:
            # this process could not look for a while (starved): silence across the gap
            # proves nothing
            self._changed = now if self._changed is not None else None
        self._last_read = now
        value = self._read()
        if value:
            if value != self._value:
                self._value, self._changed = value, now
                return None
        if self._changed is None:
            return None
        return now - self._changed

    def lost(self) -> bool:
        s = self.silent_for()
        return s is not None and s >= self.dead_after_s

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tg-batch-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            silent = self.silent_for()
            if silent is not None and silent >= self.dead_after_s:
                self.fire(silent)
                return

    def fire(self, silent: float) -> None:
        if self._fired.is_set():
            return
        self._fired.set()
        try:
            self._on_lost(silent)
        except Exception:  # never into the agent
            logger.exception("trainguard: taking over from the lost batch host failed")

    def settle(self, timeout: float) -> bool:
        """After this node's agent ended: wait until the beacon moves (False) or is judged
        lost (True, ``on_lost`` called) or ``timeout`` passes (False)."""
        self.stop()
        if self._fired.is_set():
            return True
        deadline = self._clock() + timeout
        moved_from = self._value
        while self._clock() < deadline:
            silent = self.silent_for()
            if silent is None and self._value is not None and self._value != moved_from:
                return False  # the batch shell is alive: it ends the job
            if silent is not None and silent >= self.dead_after_s:
                self.fire(silent)
                return True
            time.sleep(self._poll_s)
        return False

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
