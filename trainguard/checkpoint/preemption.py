"""Preemption notices: SIGTERM / SIGUSR1 (configurable) mark the worker preempted; the
checkpoint manager then saves at the next step boundary, waits for the commit and exits with
:data:`~trainguard.core.failures.REQUEUE_EXIT_CODE`.

A second signal stops the worker at once: with the requeue code when the preemption save has
already committed (the state is safe), else by the signal's default action.

A SIGTERM is not always a preemption notice: torch's agent tears a failed group down with
SIGTERM before a restart. trainguard's agent creates a teardown file first
(``envvars.TEARDOWN_FILE``); a worker that finds it stops at once, as it would without
trainguard's handlers, so a restart never waits for the shutdown timeout.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from trainguard.core.contracts import envvars
from trainguard.core.failures import REQUEUE_EXIT_CODE

__all__ = ["Preemption"]

logger = logging.getLogger(__name__)


class Preemption:
    def __init__(self, signals: list[str]) -> None:
        self.signals = signals
        self.signum: int | None = None
        """The first preemption signal received (None: not preempted)."""
        self.committed = False
        """The preemption save committed: a second signal still exits with the requeue code."""
        self._previous: dict[int, Any] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "peer"

    def install(self) -> None:
        """Handle the signals (main thread only; elsewhere Python does not allow it). The
        handlers that were there are kept: a teardown goes to them, :meth:`restore` puts them
        back."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.signals:
            try:
                sig = getattr(signal, name)
                previous = signal.signal(sig, self._on_signal)
            except (AttributeError, OSError, ValueError):
                logger.warning("cannot handle %s for preemption saves", name)
                continue
            if previous is not self._on_signal:
                self._previous[int(sig)] = previous

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            try:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        self._previous.clear()

    @staticmethod
    def teardown() -> bool:
        """The agent is stopping this worker group (restart or failed job), not preempting."""
        path = os.environ.get(envvars.TEARDOWN_FILE)
        return path is not None and bool(path) and os.path.exists(path)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.teardown():
            self._pass_on(signum, frame)
            return
        if self.signum is None:
            self.signum = signum
            return
        if self.committed:
            os._exit(REQUEUE_EXIT_CODE)
        self._pass_on(signum, frame)

    def _pass_on(self, signum: int, frame: object) -> None:
        """What would have happened without trainguard: the previous handler, else the
        signal's default action."""
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
            return
        if previous == signal.SIG_IGN:
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
