"""Pure logic of in-process restarts and of the memory tier's cadence (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

import trainguard
from trainguard.checkpoint.memory_cadence import MemoryCadence
from trainguard.core.config import ConfigError, load_config
from trainguard.core.inprocess import announce_key, pg_prefix, ready_key


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _drive(c: MemoryCadence, clock: Clock, steps: int, step_s: float, stall_s: float) -> list[int]:
    saved = []
    for s in range(steps):
        if c.due(s):
            c.snapshotted(s)
            saved.append(s)
            c.record_stall(stall_s)
            clock.t += stall_s
        clock.t += step_s
    return saved


def test_memory_cadence_every_step_while_the_stall_is_small() -> None:
    clock, changes = Clock(), []
    c = MemoryCadence(1, 0.05, clock=clock, on_change=lambda *a: changes.append(a))
    assert _drive(c, clock, 50, step_s=0.05, stall_s=0.002) == list(range(50))
    assert c.every == 1 and changes == []


def test_memory_cadence_stretches_to_keep_the_stall_under_the_fraction() -> None:
    clock, changes = Clock(), []
    c = MemoryCadence(1, 0.05, clock=clock, on_change=lambda *a: changes.append(a))
    saved = _drive(c, clock, 200, step_s=0.05, stall_s=0.01)  # 20 % of a step
    # 0.01 / (5 * 0.05) = 4 %: the 80 % of the 5 % it aims at (4 steps: 5 %)
    assert c.every == 5 and changes[0][0] == 5
    late = [s for s in saved if s > 100]
    assert all(b - a == 5 for a, b in zip(late, late[1:], strict=False)), late
    # the stall shrinks again: back to every step
    _drive(c, clock, 100, step_s=0.05, stall_s=0.001)
    assert c.every == 1


def test_memory_cadence_configured_interval_and_off() -> None:
    clock = Clock()
    c = MemoryCadence(5, 0.05, clock=clock)
    assert _drive(c, clock, 20, step_s=0.05, stall_s=0.0) == [0, 5, 10, 15]
    c = MemoryCadence(0, 0.05, clock=clock)
    assert _drive(c, clock, 20, step_s=0.05, stall_s=0.0) == []
    c = MemoryCadence(1, 0.0, clock=clock)  # fraction 0: never stretched
    assert len(_drive(c, clock, 40, step_s=0.01, stall_s=0.01)) == 40


def _drive_hooks(
    c: MemoryCadence, clock: Clock, steps: int, step_s: float, stall_s: float, fixed_s: float
) -> list[int]:
    """As a framework integration drives it: every step costs ``fixed_s`` in the hooks, a
    snapshot step ``stall_s`` more, and the hooks' time is reported after each step."""
    saved = []
    for s in range(steps):
        spent = fixed_s
        if c.due(s):
            c.snapshotted(s)
            saved.append(s)
            c.record_stall(stall_s)
            spent += stall_s
        clock.t += step_s + spent
        c.record_overhead(spent)
    return saved


def test_memory_cadence_shares_the_budget_with_the_reported_fixed_cost() -> None:
    clock = Clock()
    c = MemoryCadence(1, 0.01, clock=clock)  # 1 % of a 100 ms step: 1 ms per step
    saved = _drive_hooks(c, clock, 400, step_s=0.1, stall_s=0.002, fixed_s=0.0005)
    # it aims at 80 % of the budget, 0.8 ms a step: without the fixed cost every 3 steps;
    # with it the snapshots get 0.3 ms a step: every 7, the next rung 8
    assert c.fixed_s == pytest.approx(0.0005) and c.every == 8
    late = [s for s in saved if s > 200]
    assert all(b - a == 8 for a, b in zip(late, late[1:], strict=False)), late
    spent = 0.0005 + 0.002 / c.every
    assert spent <= 0.01 * 0.1 + 1e-9  # trainguard's whole share within the budget
    # a fixed cost above the budget leaves the snapshots a quarter of it, not nothing
    c = MemoryCadence(1, 0.01, clock=Clock())
    _drive_hooks(c, c._clock, 400, step_s=0.1, stall_s=0.002, fixed_s=0.003)  # type: ignore[arg-type]
    assert c.every == 10  # 2 ms / (0.25 * 0.8 ms) = 10
    # nothing reported: the stall alone is budgeted, as before
    c = MemoryCadence(1, 0.01, clock=Clock())
    _drive(c, c._clock, 400, step_s=0.1, stall_s=0.002)  # type: ignore[arg-type]
    assert c.fixed_s is None and c.every == 3


def test_memory_cadence_charges_the_forced_check_to_the_snapshot() -> None:
    """A check every snapshot waits for (the replicas' agreement, ``[sdc]``) is the snapshot's
    cost: 0.2 ms of stall plus 1.8 ms of check is 2 ms per snapshot, every 3 steps at 1 % of a
    100 ms step (as for a 2 ms stall), not every step (the stall alone: 0.2 ms)."""
    clock = Clock()
    c = MemoryCadence(1, 0.01, clock=clock)
    saved = []
    for s in range(400):
        if c.due(s):
            c.record_forced(0.0018)  # the check runs before the snapshot, on the same thread
            clock.t += 0.0018
            c.snapshotted(s)
            saved.append(s)
            c.record_stall(0.0002)
            clock.t += 0.0002
        clock.t += 0.1
    assert c.every == 3
    assert c.step_s == pytest.approx(0.1)  # the check is taken out of the step time
    late = [s for s in saved if s > 200]
    spent = len(late) * 0.002 / (late[-1] - late[0] + c.every)
    assert spent <= 0.01 * 0.1 + 1e-9
    # without the charge (the stall alone) it would snapshot every step: 2 % of the time
    c = MemoryCadence(1, 0.01, clock=Clock())
    _drive(c, c._clock, 400, step_s=0.1, stall_s=0.0002)  # type: ignore[arg-type]
    assert c.every == 1


def test_protocol_keys_are_distinct_per_generation_and_rank() -> None:
    assert len({pg_prefix(0), pg_prefix(1), announce_key(1), ready_key(0), ready_key(1)}) == 5
    assert pg_prefix(1).endswith("/")


def test_inprocess_config_section(tmp_path: Path) -> None:
    cfg = load_config(env={"TRAINGUARD_INPROCESS_ENABLED": "0"})
    assert cfg.inprocess.enabled is False and cfg.inprocess.join_timeout_s > 0
    with pytest.raises((ConfigError, ValueError)):
        load_config(env={"TRAINGUARD_INPROCESS_JOIN_TIMEOUT_S": "0"})


def test_run_outside_the_agent_calls_the_function_once(tmp_path: Path, monkeypatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "TRAINGUARD_AGENT_PROGRESS_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TRAINGUARD_AGENT_RUN_DIR", str(tmp_path))
    calls = []

    @trainguard.restartable
    def train(tg, x, *, y):
        calls.append((tg.rank, x, y))
        return x + y

    try:
        assert train(1, y=2) == 3 and calls == [(0, 1, 2)]
        assert trainguard.run(lambda tg: tg.generation) == 0
    finally:
        trainguard.init().close()


@pytest.mark.parametrize(("in_process", "fraction"), [(False, 0.01), (True, 0.1)])
def test_memory_cadence_default_fraction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_process: bool, fraction: float
) -> None:
    from types import SimpleNamespace

    from trainguard.checkpoint.manager import for_worker

    monkeypatch.delenv("TRAINGUARD_CHECKPOINT_MEMORY_MAX_STALL_FRACTION", raising=False)
    tg = SimpleNamespace(
        run_dir=str(tmp_path), rank=0, world_size=1, in_process=in_process,
        events=SimpleNamespace(emit=lambda *a, **k: None), log=lambda **k: None, step_num=0,
    )  # fmt: skip
    mgr = for_worker(tg)
    try:
        assert mgr.memory_cadence.max_fraction == fraction
    finally:
        mgr.close()
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_MEMORY_MAX_STALL_FRACTION", "0")
    mgr = for_worker(tg)
    try:
        assert mgr.memory_cadence.max_fraction == 0  # configured: every step, whatever it costs
    finally:
        mgr.close()
