"""Throttling a running process for real: :mod:`trainguard.chaos.throttle` (re-exported here
for the tests)."""

from __future__ import annotations

from trainguard.chaos.throttle import throttle

__all__ = ["throttle"]
