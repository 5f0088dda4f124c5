"""A worker sets up with the cyclic garbage collector off (``[warm] setup_gc_hold_s``): off from
the script's first line through its imports, on again once the first ``tg.step()`` ended or the
hold's time ran out; off by configuration it is never touched, as under torchrun."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import pytest

from tests.launch_utils import WORKERS, base_env, launch
from trainguard.core import procs
from trainguard.core.contracts import envvars


@pytest.fixture
def collector_restored():
    was = gc.isenabled()
    yield
    procs.release_worker_gc()
    (gc.enable if was else gc.disable)()


def test_the_hold_ends_at_its_time_limit(monkeypatch, collector_restored) -> None:
    monkeypatch.setenv(envvars.GC_HOLD_S, "0.3")
    gc.enable()
    procs.hold_gc_in_worker()
    assert not gc.isenabled()
    deadline = time.monotonic() + 10
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gc.isenabled()


def test_the_hold_ends_once_and_leaves_a_collector_the_script_turned_off(
    monkeypatch, collector_restored
) -> None:
    monkeypatch.setenv(envvars.GC_HOLD_S, "60")
    gc.enable()
    procs.hold_gc_in_worker()
    assert not gc.isenabled()
    procs.release_worker_gc()  # the first step's end
    assert gc.isenabled()
    gc.disable()  # the script's own choice: no later release (the timer's) undoes it
    procs.release_worker_gc()
    assert not gc.isenabled()


def test_a_process_forked_during_the_hold_runs_its_collector(monkeypatch, collector_restored):
    monkeypatch.setenv(envvars.GC_HOLD_S, "60")
    gc.enable()
    procs.hold_gc_in_worker()
    assert not gc.isenabled()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say: no timer thread came with it
        os.write(w, b"1" if gc.isenabled() else b"0")
        os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"1"
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert not gc.isenabled()  # the parent still holds it


@pytest.mark.parametrize("value", ["0", "x", ""])
def test_no_hold_where_unset_zero_or_garbled(monkeypatch, collector_restored, value) -> None:
    monkeypatch.setenv(envvars.GC_HOLD_S, value)
    gc.enable()
    procs.hold_gc_in_worker()
    assert gc.isenabled()


@pytest.mark.parametrize(("hold", "expect"), [(None, False), ("0", True)])
def test_a_workers_collector_is_off_until_its_first_step(
    tmp_path: Path, hold: str | None, expect: bool
) -> None:
    out = tmp_path / "gc.json"
    env = base_env() if hold is None else base_env(TRAINGUARD_WARM_SETUP_GC_HOLD_S=hold)
    r = launch(
        "trainguard",
        ["--nproc-per-node", "1", str(WORKERS / "gc_state.py"), str(out)],
        cwd=tmp_path,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads(out.read_text())
    assert state == {"first_line": expect, "after_import": expect, "after_first_step": True}
