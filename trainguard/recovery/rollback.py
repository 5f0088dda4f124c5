"""Loss anomalies and rollback decisions (pure logic; the worker handle does the restore).

:class:`LossMonitor` watches the logged loss: a non-finite value, or one above ``k`` times the
rolling median, is an :class:`Anomaly`. :class:`RollbackLedger` decides what a rollback does and
remembers it: which checkpoint is acceptable (at or before the first skipped step; older than
the last restore when the anomaly comes back at the same place), which step window the data
loop skips, and when rollbacks at one place are exhausted (the job then stops with the "do not
requeue" code). The ledger is a small JSON file in the run directory, so a restarted worker
keeps skipping what was skipped.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.core.atomicfile import write_atomic
from trainguard.core.config.rollback import RollbackConfig

__all__ = [
    "LEDGER_FILE",
    "Anomaly",
    "LossMonitor",
    "RollbackLedger",
    "RollbackPlan",
]

LEDGER_FILE = "rollback.json"
"""``<run_dir>/rollback.json``: the skipped windows and the last rollback."""


@dataclass(frozen=True, slots=True)
class Anomaly:
    step: int
    reason: str
    """``nan``, ``inf`` or ``spike``."""
    value: float
    median: float | None = None

    def describe(self) -> str:
        if self.reason == "spike":
            return f"loss {self.value:.4g} > spike threshold ({self.median:.4g} median)"
        return f"loss is {self.value}"


class LossMonitor:
    """Rolling history of one logged value; :meth:`observe` returns an anomaly or None."""

    def __init__(self, config: RollbackConfig) -> None:
        self.config = config
        self._hist: deque[tuple[int, float]] = deque(maxlen=config.window)

    def median(self) -> float | None:
        return statistics.median(v for _, v in self._hist) if self._hist else None

    def observe(self, step: int, value: Any) -> Anomaly | None:
        try:
            v = float(value)
        except (TypeError, ValueError):
            return None  # not a number: nothing to judge
        cfg = self.config
        if not math.isfinite(v):
            if not cfg.nonfinite:
                return None
            return Anomaly(step, "nan" if math.isnan(v) else "inf", v, self.median())
        if cfg.spike_factor > 0 and len(self._hist) >= max(1, cfg.min_history):
            med = self.median()
            if med is not None and med > 0 and v > cfg.spike_factor * med:
                return Anomaly(step, "spike", v, med)  # not added: it would raise the median
        self._hist.append((step, v))
        return None

    def forget_from(self, step: int) -> None:
        """Drop the values of steps >= ``step`` (they are being redone after a rollback)."""
        kept = [(s, v) for s, v in self._hist if s < step]
        self._hist.clear()
        self._hist.extend(kept)


@dataclass(frozen=True, slots=True)
class RollbackPlan:
    """What one rollback does, decided before the restore."""

    bad_step: int
    count: int
    """Rollbacks at this place, this one included."""
    stop: bool
    """Rollbacks at this place are exhausted: stop the job (exit 93)."""
    max_step: int
    """Restore the newest checkpoint at or before this step."""
    first: int | None
    """First skipped step; None: the restored step (a repeat at the same place)."""
    last: int
    """Last skipped step (inclusive)."""


@dataclass(slots=True)
class _Last:
    restored: int
    first: int
    last: int
    count: int


@dataclass(slots=True)
class RollbackLedger:
    """Skipped windows (inclusive step ranges) and the rollbacks at the current place."""

    config: RollbackConfig
    windows: list[tuple[int, int]] = field(default_factory=list)
    last: _Last | None = None
    total: int = 0

    # -- decisions -------------------------------------------------------------------------------
    def plan(self, bad_step: int) -> RollbackPlan:
        cfg, last = self.config, self.last
        same = last is not None and last.restored <= bad_step <= last.last + cfg.place_steps
        if same:
            assert last is not None
            count = last.count + 1
            return RollbackPlan(
                bad_step=bad_step,
                count=count,
                stop=count > cfg.max_rollbacks,
                max_step=last.restored - 1,
                first=None,
                last=max(last.last, bad_step + cfg.skip_after),
            )
        first = max(0, bad_step - cfg.skip_before)
        return RollbackPlan(
            bad_step=bad_step,
            count=1,
            stop=cfg.max_rollbacks < 1,
            max_step=first,
            first=first,
            last=bad_step + cfg.skip_after,
        )

    def commit(self, plan: RollbackPlan, restored_step: int) -> tuple[int, int]:
        """Record a rollback that restored ``restored_step``; returns the skipped window."""
        first = restored_step if plan.first is None else plan.first
        window = (first, plan.last)
        self.windows = _merge([*self.windows, window])
        self.last = _Last(restored=restored_step, first=first, last=plan.last, count=plan.count)
        self.total += 1
        return window

    # -- the data loop ---------------------------------------------------------------------------
    def should_skip(self, step: int) -> bool:
        return any(a <= step <= b for a, b in self.windows)

    def next_step(self, step: int) -> int:
        """``step``, or the first step after the skipped window(s) containing it."""
        for a, b in self.windows:  # sorted and merged: one pass
            if a <= step <= b:
                step = b + 1
        return step

    # -- persistence -----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "windows": [list(w) for w in self.windows],
            "last": asdict(self.last) if self.last is not None else None,
            "total": self.total,
            "time": time.time(),
        }

    def save(self, run_dir: Path) -> None:
        """Atomic write of ``<run_dir>/rollback.json`` (every rank writes the same content)."""
        write_atomic(Path(run_dir) / LEDGER_FILE, json.dumps(self.to_json()) + "\n")

    @classmethod
    def load(cls, run_dir: Path, config: RollbackConfig) -> RollbackLedger:
        """The ledger of this run (empty when there is none or it is unreadable)."""
        ledger = cls(config)
        try:
            data = json.loads((Path(run_dir) / LEDGER_FILE).read_text())
            ledger.windows = _merge((int(a), int(b)) for a, b in data.get("windows") or [])
            last = data.get("last")
            if isinstance(last, dict):
                ledger.last = _Last(**{k: int(last[k]) for k in _Last.__slots__})
            ledger.total = int(data.get("total") or 0)
        except (OSError, ValueError, TypeError, KeyError):
            pass
        return ledger


def _merge(windows: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(windows):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
