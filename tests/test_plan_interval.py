"""checkpoint ``auto_interval``: the planner's disk optimum for the costs a job measures."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.checkpoint.interval import (
    observed_memory_fraction,
    planned_interval_s,
    young_interval_s,
)
from trainguard.core.events import EventLog
from trainguard.plan import daly_interval

H = 3600.0


@pytest.mark.parametrize(("stall", "mtbf"), [(6.0, 3 * H), (6.0, 600.0), (0.05, 24 * H)])
def test_without_lag_or_memory_tier_it_is_dalys_optimum(stall: float, mtbf: float) -> None:
    assert planned_interval_s(stall, mtbf) == pytest.approx(daly_interval(stall, mtbf), rel=0.02)


def test_measured_costs_move_the_interval() -> None:
    base = planned_interval_s(0.05, 3 * H)
    # a save is usable only once committed: a lag shortens the interval a little, never
    # below the commit time itself (one persist in flight)
    lagged = planned_interval_s(0.05, 3 * H, commit_s=2.1)
    assert 2.1 <= lagged <= base
    assert planned_interval_s(0.05, 60.0, commit_s=30.0) >= 30.0
    # most failures recovered from memory: the disk is needed less often, so less often saved
    assert planned_interval_s(0.05, 3 * H, memory_fraction=0.9) == pytest.approx(
        base * 10**0.5, rel=0.1
    )
    assert planned_interval_s(0.05, 3 * H, lo=60.0) == 60.0
    assert young_interval_s(0.05, 3 * H) == pytest.approx(base, rel=0.02)


def test_memory_fraction_from_the_events(tmp_path: Path) -> None:
    assert observed_memory_fraction(tmp_path) == 0.0
    log = EventLog(tmp_path, node="n0")
    log.emit("checkpoint_restored", attempt=0, rank=0, source="none")  # the first start
    log.emit("checkpoint_restored", attempt=1, rank=0, source="memory")
    log.emit("checkpoint_restored", attempt=1, rank=1, source="memory")  # rank 0 counts
    log.emit("checkpoint_restored", attempt=2, rank=0, source="disk")
    log.emit("checkpoint_restored", attempt=3, rank=0, source="peer_memory")
    assert observed_memory_fraction(tmp_path) == pytest.approx(2 / 3)
