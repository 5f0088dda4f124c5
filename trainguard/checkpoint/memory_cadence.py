"""How often the memory tier snapshots: every step when its stall allows.

A restart redoes the steps since the newest snapshot every rank holds, so a snapshot every
step bounds the loss at one step (in-process and fast restarts). A snapshot's stall is a host
copy (plus, on a GPU, nothing the training stream waits for), usually a small fraction of a
step; where it is not (a huge state, short steps), snapshotting every step would cost more
than the steps it saves. :class:`MemoryCadence` measures both, the median stall of recent
memory-only snapshots and the median wall time of a step (between ``maybe_save`` calls, the
stall taken out), and stretches the configured ``memory_every_steps`` to the smallest
interval whose stall stays within ``memory_max_stall_fraction`` of the training time.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable

__all__ = ["MemoryCadence"]

WINDOW = 32
"""Recent measurements the medians are taken over."""
MIN_SAMPLES = 5
"""Measurements needed before the cadence departs from the configured interval."""
MAX_EVERY = 10_000


class MemoryCadence:
    """Decides, step by step, whether the memory tier snapshots this step (per rank; the
    manager agrees with the other ranks, so all snapshot when any one is due)."""

    def __init__(
        self,
        every_steps: int,
        max_stall_fraction: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[int, float, float], None] | None = None,
    ) -> None:
        self.base = every_steps
        self.max_fraction = max_stall_fraction
        self.every = every_steps
        """The current interval in steps (0: off)."""
        self._clock = clock
        self._on_change = on_change
        self._stalls: deque[float] = deque(maxlen=WINDOW)
        self._steps: deque[float] = deque(maxlen=WINDOW)
        self._last_call: float | None = None
        self._stall_since_call = 0.0
        self._last_snapshot: int | None = None

    def due(self, step: int) -> bool:
        """Called once per step boundary (``maybe_save``): snapshot now?"""
        self.tick()
        return self.is_due(step)

    def tick(self) -> None:
        """A step boundary passed (measures the step time; ``due`` calls it)."""
        now = self._clock()
        if self._last_call is not None:
            self._steps.append(max(now - self._last_call - self._stall_since_call, 0.0))
        self._last_call = now
        self._stall_since_call = 0.0

    def is_due(self, step: int) -> bool:
        """Is a snapshot due at ``step`` (no measurement)?"""
        if self.every <= 0:
            return False
        if self.every == self.base:
            return step % self.every == 0
        last = self._last_snapshot  # stretched: count from the last snapshot
        return last is None or step - last >= self.every or step < last

    def next_due(self, step: int) -> int | None:
        """The first boundary after ``step`` at which a snapshot is due (None: off)."""
        if self.every <= 0:
            return None
        if self.every == self.base:
            return (step // self.every + 1) * self.every
        last = self._last_snapshot
        if last is None or step < last:
            return step + 1
        return max(last + self.every, step + 1)

    def snapshotted(self, step: int) -> None:
        self._last_snapshot = step

    def record_stall(self, stall_s: float) -> None:
        """The stall of one memory-only snapshot (the training time it took)."""
        self._stall_since_call += stall_s
        self._stalls.append(stall_s)
        self._adapt()

    @property
    def stall_s(self) -> float | None:
        return statistics.median(self._stalls) if self._stalls else None

    @property
    def step_s(self) -> float | None:
        return statistics.median(self._steps) if self._steps else None

    def _adapt(self) -> None:
        if self.base <= 0 or self.max_fraction <= 0:
            return
        if len(self._stalls) < MIN_SAMPLES or len(self._steps) < MIN_SAMPLES:
            return
        stall, step = self.stall_s, self.step_s
        assert stall is not None and step is not None
        # stall / (every * step) <= fraction  →  every >= stall / (fraction * step)
        need = math.ceil(stall / (self.max_fraction * max(step, 1e-9)) - 1e-9)
        every = min(max(self.base, need), MAX_EVERY)
        if every != self.every:
            self.every = every
            if self._on_change is not None:
                self._on_change(every, stall, step)
