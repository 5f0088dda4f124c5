"""Preemption notices: SIGTERM / SIGUSR1 (configurable) mark the worker preempted; the
checkpoint manager then saves at the next step boundary, waits for the commit and exits with
:data:`~trainguard.core.failures.REQUEUE_EXIT_CODE`.

A second signal stops the worker at once: with the requeue code when the preemption save has
already committed (the state is safe), else by the signal's default action.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

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

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "peer"

    def install(self) -> None:
        """Handle the signals (main thread only; elsewhere Python does not allow it)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.signals:
            try:
                signal.signal(getattr(signal, name), self._on_signal)
            except (OSError, ValueError):
                logger.warning("cannot handle %s for preemption saves", name)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
            return
        if self.committed:
            os._exit(REQUEUE_EXIT_CODE)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
