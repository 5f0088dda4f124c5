"""The default ``persist_mode = "auto"``: where a job's saves persist, chosen and logged once.

A real manager, real saves, a real persister process (one start, in one test); the size
threshold is lowered so a small model stands for a large state.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from trainguard.checkpoint import manager as manager_mod
from trainguard.checkpoint import persist_proc
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.core.config.checkpoint import CheckpointConfig

LOGGER = "trainguard.checkpoint.persist_proc"


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[str, dict]] = []

    def __call__(self, kind: str, **fields: object) -> None:
        self.items.append((kind, fields))

    def kinds(self, kind: str) -> list[dict]:
        return [f for k, f in self.items if k == kind]


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    m(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    return {"model": m, "optim": opt}


def _choices(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "persist" in r.message]


@pytest.fixture(autouse=True)
def _fresh_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(persist_proc, "_logged_choices", set())


def test_auto_is_the_default_and_a_large_state_persists_in_a_persister_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``auto`` (the default) with a state over the threshold and no memory tier: the
    persister starts at the first save to disk (which persists in the thread meanwhile),
    the slots move to shared memory, and once the persister is ready saves commit through
    it; the choice is logged once for two managers; a restore is exact."""
    assert CheckpointConfig().persist_mode == "auto"
    caplog.set_level(logging.INFO, logger=LOGGER)
    monkeypatch.setattr(manager_mod, "AUTO_PROCESS_MIN_BYTES", 1)
    events = Events()
    state = _state()
    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"), memory_tier=False)
    mgr = CheckpointManager(config=cfg, events=events, install_signal_handlers=False)
    try:
        assert mgr._private_dir is None  # "auto" makes it when its persister starts
        assert mgr.save(0, state, persist=False).wait_staged(60)
        first = mgr.save(1, state)
        assert first.wait(120) and not first.via_process  # the persister is starting
        private = mgr._private_dir
        assert private is not None and private.is_dir()
        assert len(events.kinds("checkpoint_persister_started")) == 1
        step, deadline = 2, time.monotonic() + 120
        while True:
            r = mgr.save(step, state)
            assert r.wait(120)
            if r.via_process or time.monotonic() > deadline:
                break
            step += 1
            time.sleep(0.2)
        assert r.via_process, "the persister never became ready"
        modes = [e["persist_mode"] for e in events.kinds("checkpoint_committed")]
        assert modes[0] == "thread" and modes[-1] == "process", modes
        assert len(events.kinds("checkpoint_persister_started")) == 1
        other = CheckpointManager(config=cfg, install_signal_handlers=False)
        restored = _state()
        with torch.no_grad():
            for p in restored["model"].parameters():  # type: ignore[attr-defined]
                p.zero_()
        assert other.restore(restored) == step
        other.close()
        for a, b in zip(
            state["model"].parameters(),  # type: ignore[attr-defined]
            restored["model"].parameters(),  # type: ignore[attr-defined]
            strict=True,
        ):
            assert torch.equal(a, b)
    finally:
        mgr.close()
    assert not private.exists()
    assert _choices(caplog) == [
        "checkpoint persist_mode=auto: persisting in a persister process per rank "
        "(a state of 64 MiB or more per rank; a smaller one in a thread)"
    ]


def test_auto_with_a_small_state_persists_in_the_thread_without_a_persister(
    tmp_path: Path,
) -> None:
    events = Events()
    state = _state()
    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"), memory_tier=False)
    mgr = CheckpointManager(config=cfg, events=events, install_signal_handlers=False)
    try:
        for step in range(3):
            r = mgr.save(step, state)
            assert r.wait(60) and not r.via_process
        assert mgr._supervisor.proc is None and mgr._private_dir is None
        assert not events.kinds("checkpoint_persister_started")
        assert {e["persist_mode"] for e in events.kinds("checkpoint_committed")} == {"thread"}
    finally:
        mgr.close()


@pytest.mark.parametrize("mode", ["auto", "process"])
def test_where_no_process_can_run_saves_persist_in_the_thread_and_say_why_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    """No shared-memory root to stage in: the thread persists, and the reason is logged once
    (a warning where ``process`` was asked for, information for ``auto``)."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    monkeypatch.setattr(manager_mod, "AUTO_PROCESS_MIN_BYTES", 1)
    events = Events()
    state = _state()
    missing = tmp_path / "no-shm"
    cfg = CheckpointConfig(
        dir=str(tmp_path / "ckpt"), memory_tier=False, persist_mode=mode, memory_root=str(missing)
    )
    managers = [
        CheckpointManager(config=cfg, events=events, install_signal_handlers=False)
        for _ in range(2)
    ]
    try:
        for mgr in managers:
            assert mgr.save(0, state, persist=False).wait_staged(60)
            r = mgr.save(1, state)
            assert r.wait(60) and not r.via_process
            assert mgr._supervisor.proc is None
    finally:
        for mgr in managers:
            mgr.close()
    assert not events.kinds("checkpoint_persister_started")
    assert {e["persist_mode"] for e in events.kinds("checkpoint_committed")} == {"thread"}
    lines = [r for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert f"{missing} does not exist" in lines[0].getMessage()
    assert lines[0].levelno == (logging.WARNING if mode == "process" else logging.INFO)
