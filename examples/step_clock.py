"""Steady-state step time for the framework examples (``bench/integrations.py`` reads the line
they print): from the end of step ``skip`` to the end of the last step, so that start-up, the
first steps' warm-up and one-off costs (a callback's set-up, a first snapshot) stay out of a
per-step comparison."""

from __future__ import annotations

import time
from typing import Any


class StepClock:
    def __init__(self, skip: int = 5) -> None:
        self.skip = skip
        self.steps = 0
        self.start: float | None = None
        self.last: float | None = None

    def tick(self) -> None:
        """At the end of every optimizer step."""
        self.steps += 1
        self.last = time.perf_counter()
        if self.steps == self.skip:
            self.start = self.last

    def line(self) -> str:
        if self.start is None or self.last is None or self.steps <= self.skip:
            return f"steady: fewer than {self.skip + 1} steps"
        n, s = self.steps - self.skip, self.last - self.start
        return f"steady: {n} steps in {s:.3f} s ({s / n * 1000:.2f} ms/step)"


def hf_callback(clock: StepClock) -> Any:
    """A transformers ``TrainerCallback`` (TRL's trainers too) that ticks ``clock``."""
    from transformers import TrainerCallback

    class _Tick(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.tick()

    return _Tick()


def lightning_callback(clock: StepClock) -> Any:
    """A Lightning ``Callback`` that ticks ``clock``."""
    import lightning.pytorch as L

    class _Tick(L.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            clock.tick()

    return _Tick()
