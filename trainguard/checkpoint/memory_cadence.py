"""How often the memory tier snapshots: every step when its stall allows.

A restart redoes the steps since the newest snapshot every rank holds, so a snapshot every
step bounds the loss at one step (in-process and fast restarts). A snapshot's stall is a host
copy (plus, on a GPU, nothing the training stream waits for), usually a small fraction of a
step; where it is not (a huge state, short steps), snapshotting every step would cost more
than the steps it saves. :class:`MemoryCadence` measures both, the median cost of recent
memory-only snapshots (the training thread's stall plus the stager thread's CPU time: on a
CPU it shares the cores with training) and the mean wall time of a step (between
``maybe_save`` calls, the stall taken out), and stretches the configured
``memory_every_steps`` to the smallest interval whose cost stays within
``memory_max_stall_fraction`` of the training time.

Where a caller reports trainguard's whole time on the training thread at each step
(:meth:`MemoryCadence.record_overhead`: a framework integration times its own hooks), the
fraction is trainguard's budget as a whole: the snapshots get what the fixed per-step cost
(the mean over recent steps without a snapshot: heartbeat, metrics, the ranks' agreements)
leaves of it, and never less than :data:`MIN_SNAPSHOT_SHARE` of it.

Work a snapshot forces on the training thread before it (the replicas' agreement check of
``[sdc]``, which every snapshot waits for: :meth:`MemoryCadence.record_forced`) is part of the
snapshot's cost, and not of the step's.
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
AIM = 0.8
"""The share of the budget the cadence aims at: its inputs are medians and means over a few
dozen steps of a shared machine, and one snapshot costs up to a quarter more or less than
another (aiming at all of it goes over about half the time)."""
MIN_SNAPSHOT_SHARE = 0.25
"""The share of the budget the snapshots keep however much the fixed per-step cost takes."""


def _rung(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32... (four rungs per
    doubling from 4 on) that is at least ``n``."""
    if n <= 4:
        return max(n, 1)
    base = 1 << (n.bit_length() - 3)  # n in [4 base, 8 base)
    for k in (4, 5, 6, 8):
        if k * base >= n:
            return k * base
    return 8 * base


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
        self._overheads: deque[float] = deque(maxlen=WINDOW)
        self._snapshot_hooks: deque[float] = deque(maxlen=WINDOW)
        self._snapshot_outside: deque[float] = deque(maxlen=WINDOW)
        self._snapshot_pending = False
        self._forced: deque[float] = deque(maxlen=WINDOW)

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
        self._snapshot_pending = True

    def record_overhead(self, seconds: float) -> None:
        """trainguard's time on the training thread at one step, whatever it did (called
        once per step, after ``maybe_save``): a step without a snapshot measures the fixed
        cost the snapshots' budget is shared with, a step with one what the snapshot took
        beyond it."""
        if self._snapshot_pending:
            self._snapshot_pending = False
            fixed = self.fixed_s
            if fixed is not None:
                self._snapshot_hooks.append(max(seconds - fixed, 0.0))
            return
        self._overheads.append(seconds)
        if len(self._overheads) % 8 == 0:
            self._adapt()

    @property
    def fixed_s(self) -> float | None:
        """The mean fixed cost per step reported through :meth:`record_overhead`."""
        if len(self._overheads) < MIN_SAMPLES:
            return None
        return statistics.fmean(self._overheads)

    def record_stall(
        self, stall_s: float, *, background_s: float = 0.0, in_step_s: float = 0.0
    ) -> None:
        """The stall of one memory-only snapshot (the training time it took; ``in_step_s``
        of it inside the training step, not in a call to trainguard), and the CPU time a
        background thread spent on it (budgeted with it, not part of the step)."""
        self._stall_since_call += stall_s
        self._stalls.append(stall_s + background_s)
        self._snapshot_outside.append(in_step_s + background_s)
        self._adapt()

    def record_forced(self, seconds: float) -> None:
        """Work on the training thread that the snapshot at this boundary forced before it
        (a check the snapshot waits for): charged to the snapshot, taken out of the step."""
        self._stall_since_call += seconds
        self._forced.append(seconds)

    @property
    def stall_s(self) -> float | None:
        """A snapshot's cost: where the hooks' time is reported, what a snapshot step took in
        them beyond the fixed cost (the forced work included), plus what it took outside them
        (the stall inside the step, the stager's CPU); else its stall plus the stager's CPU
        plus the work it forced. Medians."""
        if self._snapshot_hooks and self._snapshot_outside:
            return statistics.median(self._snapshot_hooks) + statistics.median(
                self._snapshot_outside
            )
        if not self._stalls:
            return None
        forced = statistics.median(self._forced) if self._forced else 0.0
        return statistics.median(self._stalls) + forced

    @property
    def step_s(self) -> float | None:
        """The mean time of a recent step, the longest eighth left out (an evaluation or a
        persist in one step does not stretch the budget of the next ones): a mean, since
        the budget is a share of the training time, and steps of a job can alternate
        between two durations (a median would then take the shorter)."""
        if not self._steps:
            return None
        kept = sorted(self._steps)[: len(self._steps) - len(self._steps) // 8]
        return statistics.fmean(kept)

    def _adapt(self) -> None:
        if self.base <= 0 or self.max_fraction <= 0:
            return
        if len(self._stalls) < MIN_SAMPLES or len(self._steps) < MIN_SAMPLES:
            return
        stall, step = self.stall_s, self.step_s
        assert stall is not None and step is not None
        # stall / every <= share of fraction * step  →  every >= stall / share
        budget = AIM * self.max_fraction * max(step, 1e-9)
        share = max(budget - (self.fixed_s or 0.0), budget * MIN_SNAPSHOT_SHARE)
        need = max(self.base, math.ceil(stall / share - 1e-9))
        every = self.every
        # stretched to the next rung of a ladder (steps of about 1/4), shortened only when a
        # lower rung is clearly enough: noisy measurements do not move it back and forth
        if need > every or (need < every and need <= every * 0.7):
            every = min(_rung(need), MAX_EVERY) if need > self.base else self.base
        if every != self.every:
            self.every = every
            if self._on_change is not None:
                self._on_change(every, stall, step)
