"""The worker handle and the progress channel, without and with an agent."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch_utils import REPO, base_env, launch
from trainguard.core.progress import ProgressReader, ProgressWriter, progress_path

SCRIPT = """
import trainguard
tg = trainguard.init()
for i in range(3):
    with tg.step(tokens=128, samples=4):
        pass
    tg.log(loss=1.0 / (i + 1), note="x")
print(tg.run_dir, tg.rank, tg.world_size, tg.under_agent)
tg.close()
"""


def test_plain_python_writes_run_dir(tmp_path: Path) -> None:
    env = base_env()
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    run_dir, rank, world, under = out.stdout.split()
    assert (rank, world, under) == ("0", "1", "False")
    run_dir = tmp_path / run_dir
    assert run_dir.parent.name == "trainguard-runs"
    records = [
        json.loads(x) for x in (run_dir / "metrics" / "rank_0.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if r["kind"] == "step"]
    logs = [r for r in records if r["kind"] == "log"]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all(r["tokens"] == 128 and r["samples"] == 4 and r["step_time_s"] >= 0 for r in steps)
    assert [r["loss"] for r in logs] == [1.0, 0.5, 1.0 / 3]


def test_under_torchrun_shares_run_dir_by_run_id(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(SCRIPT)
    r = launch("torchrun", ["--standalone", "--nproc-per-node", "2", "w.py"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    dirs = list((tmp_path / "trainguard-runs").iterdir())
    assert len(dirs) == 1
    assert sorted(p.name for p in (dirs[0] / "metrics").iterdir()) == [
        "rank_0.jsonl",
        "rank_1.jsonl",
    ]


def test_under_agent_progress_is_visible(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(SCRIPT)
    r = launch(
        "trainguard",
        ["--standalone", "--nproc-per-node", "2", "--tg-run-dir", "run", "w.py"],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    reader = ProgressReader(tmp_path / "run" / "progress" / "attempt_0")
    snaps = reader.read_all()
    assert sorted(snaps) == [0, 1]
    for s in snaps.values():
        assert s.step == 2 and s.num_steps == 3 and not s.in_step and s.pid > 0
    assert "True" in r.stdout


def test_progress_writer_heartbeat_and_steps(tmp_path: Path) -> None:
    w = ProgressWriter(progress_path(tmp_path, 3), heartbeat_interval_s=0.05)
    try:
        r = ProgressReader(tmp_path)
        first = r.read(3)
        assert first is not None and first.pid == os.getpid() and first.num_steps == 0
        w.step_begin(7)
        mid = r.read(3)
        assert mid.step == 7 and mid.in_step
        w.step_end(7, 0.25)
        end = r.read(3)
        assert end.step == 7 and not end.in_step and end.last_step_s == 0.25 and end.num_steps == 1
        beat = end.heartbeat
        deadline = time.monotonic() + 5
        while r.read(3).heartbeat == beat:
            assert time.monotonic() < deadline, "heartbeat thread did not refresh"
            time.sleep(0.02)
    finally:
        w.close()
    assert ProgressReader(tmp_path / "missing").read_all() == {}


def test_a_closed_progress_record_stays_finishing(tmp_path: Path) -> None:
    import threading

    from trainguard.core.flight_recorder import _Watcher

    # the record's last word is "finishing" (an endless heartbeat), whatever writes after it
    w = ProgressWriter(progress_path(tmp_path, 0), heartbeat_interval_s=0.01)
    w.step_end(4, 0.1)
    w.close()
    with pytest.raises(ValueError):
        w.step_end(5, 0.1)
    snap = ProgressReader(tmp_path).read(0)
    assert snap is not None and snap.step == 4 and snap.heartbeat == float("inf")

    # the exit hook finishing while the watcher thread closes the same record returns only
    # once the record is closed
    class SlowClose(ProgressWriter):
        def close(self) -> None:
            time.sleep(0.3)
            super().close()

    watcher = _Watcher(0.05)
    watcher.writer = SlowClose(progress_path(tmp_path, 1), heartbeat_interval_s=5.0)
    t = threading.Thread(target=watcher._finish)
    t.start()
    deadline = time.monotonic() + 5
    while watcher.writer is not None:  # the watcher thread holds the record now
        assert time.monotonic() < deadline
        time.sleep(0.001)
    watcher._finish()
    assert ProgressReader(tmp_path).read(1).heartbeat == float("inf")
    t.join()


def test_cli_events_command(tmp_path: Path) -> None:
    from trainguard.core.events import EventLog

    log = EventLog(tmp_path, node="n1", context=lambda: {"attempt": 2, "agent_restarts": 2})
    log.emit("launch", pid=1)
    out = subprocess.run(
        [sys.executable, "-m", "trainguard", "events", str(tmp_path)],
        capture_output=True,
        text=True,
        env=base_env(),
        cwd=REPO,
    )
    assert out.returncode == 0 and "launch" in out.stdout and "n1" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "trainguard", "events", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env=base_env(),
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


# -- a worker API without traps ----------------------------------------------------------------
def test_init_is_idempotent_and_log_refuses_reserved_keys(tmp_path: Path) -> None:

    import pytest

    import trainguard

    tg = trainguard.init(run_dir=tmp_path / "run")
    try:
        assert trainguard.init() is tg
        assert trainguard.init(run_dir=tmp_path / "run") is tg
        with pytest.raises(ValueError, match="already writes to"):
            trainguard.init(run_dir=tmp_path / "other")
        for key in ("time", "kind", "rank", "attempt"):
            with pytest.raises(ValueError, match=f"tg.log\\({key}=...\\): {key} is reserved"):
                tg.log(**{key: 1.0, "loss": 0.5})
        tg.log(loss=0.5, time_s=2.0)  # fine: not a record field
        # one meaning per name: torch's per-agent count and the job-wide attempt
        assert tg.agent_restarts == 0 and tg.attempt == 0
        assert not hasattr(tg, "restart_count")  # the old alias of agent_restarts is gone
    finally:
        tg.close()
    (rec,) = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics" / "rank_0.jsonl").read_text().splitlines()
    ]
    assert rec["kind"] == "log" and rec["loss"] == 0.5 and rec["time_s"] == 2.0
    assert rec["rank"] == 0 and rec["attempt"] == 0 and rec["time"] > 1e9
    again = trainguard.init(run_dir=tmp_path / "run2")  # a closed handle is replaced
    try:
        assert again is not tg
    finally:
        again.close()


def test_save_result_says_staged_or_committed(tmp_path: Path) -> None:
    import torch
    from torch import nn

    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.core.config.checkpoint import CheckpointConfig

    m = nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    state = {"model": m, "optim": opt}
    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"), memory_tier=False)
    mgr = CheckpointManager(config=cfg, install_signal_handlers=False)
    try:
        mem = mgr.save(1, state, persist=False)
        assert mem.wait_staged(timeout=60) and mem.staged
        assert mem.wait(timeout=60) is False and not mem.committed  # never commits
        disk = mgr.save(2, state)
        assert disk.wait(timeout=60) is True and disk.committed and disk.staged
    finally:
        mgr.close()
    m2 = nn.Linear(4, 4)
    fresh = CheckpointManager(config=cfg, install_signal_handlers=False)
    seen: list[int] = []
    fresh.on_restore(seen.append)
    try:
        st = {"model": m2, "optim": torch.optim.SGD(m2.parameters(), lr=0.1)}
        assert fresh.restore_or_init(st) == 2 and seen == [2]
        assert torch.equal(m2.weight, m.weight)
    finally:
        fresh.close()


TOUCH_ONE_RANK = """
import signal, sys, torch, torch.distributed as dist
from torch import nn
import trainguard

mode = sys.argv[1]
tg = trainguard.init()
assert trainguard.init() is tg
dist.init_process_group("gloo")
torch.manual_seed(0)
m = nn.Linear(4, 4)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
state = {"model": m, "optim": opt}
if mode == "save":
    if tg.rank == 0:  # touched on one rank only: no collective, no signal handler
        before = signal.getsignal(signal.SIGUSR1)
        assert tg.checkpoint.config.enabled
        assert signal.getsignal(signal.SIGUSR1) == before
    dist.barrier()  # rank 0 would still sit in new_group here if touching were collective
    for _ in range(3):
        with tg.step():
            loss = m(torch.ones(2, 4)).sum()
            opt.zero_grad(); loss.backward(); opt.step()
    res = tg.checkpoint.save(tg.step_num, state)  # every rank: the collective setup runs here
    assert res.wait(timeout=60) and res.committed and res.staged
    sys.stdout.write(f"SAVED {tg.rank} {tg.step_num}\\n")  # one write: ranks share stdout
    sys.stdout.flush()
else:
    start = tg.checkpoint.restore_or_init(state)
    assert start == tg.step_num == 3, (start, tg.step_num)
    sys.stdout.write(f"RESTORED {tg.rank} {tg.step_num}\\n")
    sys.stdout.flush()
tg.checkpoint.close()
dist.barrier()
dist.destroy_process_group()
tg.close()
"""


@pytest.mark.slow
def test_checkpoint_touched_on_one_rank_then_saved_on_every_rank(tmp_path: Path) -> None:
    """``tg.checkpoint`` on rank 0 only, then ``save`` on every rank: no deadlock; a restore
    in a new job sets the handle's step."""
    import signal as sig

    script = tmp_path / "touch.py"
    script.write_text(TOUCH_ONE_RANK)
    env = base_env(TRAINGUARD_CHECKPOINT_DIR=str(tmp_path / "ckpt"))
    for mode in ("save", "restore"):
        p = subprocess.Popen(
            [sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
             "--tg-run-dir", str(tmp_path / mode), str(script), mode],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            out, err = p.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, sig.SIGKILL)
            out, err = p.communicate()
            raise AssertionError(f"{mode}: deadlock (killed after 150 s): {err[-3000:]}") from None
        finally:
            try:
                os.killpg(p.pid, sig.SIGKILL)
            except ProcessLookupError:
                pass
        assert p.returncode == 0, err[-3000:]
        word = "SAVED" if mode == "save" else "RESTORED"
        found = sorted(re.findall(rf"{word} \d+ \d+", out))
        assert found == [f"{word} 0 3", f"{word} 1 3"], out


def test_event_bus_delivers_in_process(tmp_path: Path) -> None:
    """EventLog's bus: emit is written and delivered, publish only delivered; kinds filter;
    a raising listener is logged, not raised; unsubscribe stops delivery."""
    from trainguard.core.events import EventLog, read_events

    log = EventLog(tmp_path, node="n1", context=lambda: {"attempt": 1})
    got: list[dict] = []
    everything: list[str] = []
    stop = log.subscribe(got.append, kinds=["scores"])
    log.subscribe(lambda e: everything.append(e["kind"]))
    log.subscribe(lambda e: 1 / 0)  # a broken listener does not stop the others
    log.publish("scores", scores={"0": 0.1})
    log.emit("launch", pid=1)
    stop()
    log.publish("scores", scores={"0": 0.2})
    assert [(e["kind"], e["scores"], e["attempt"], e["node"]) for e in got] == [
        ("scores", {"0": 0.1}, 1, "n1")
    ]
    assert everything == ["scores", "launch", "scores"]
    assert [e["kind"] for e in read_events(tmp_path)] == ["launch"]  # published: not written


def test_worker_under_agent_with_an_unreadable_config_fails_in_one_line(tmp_path: Path) -> None:
    """A worker never silently runs on other settings than its agent resolved."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text('{"trainguard": {"runtime": ')  # torn write
    env = base_env(
        TRAINGUARD_AGENT_RUN_DIR=str(run_dir),
        TRAINGUARD_AGENT_PROGRESS_DIR=str(run_dir / "progress" / "attempt_0"),
    )
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr  # one line
    assert "config.json" in p.stderr and "Traceback" not in p.stderr
    # the agent-to-worker variables are never read as settings (no "unknown setting" error)
    from trainguard.core.config import load_config

    load_config(env={"TRAINGUARD_AGENT_MEMORY_DIR": "/dev/shm/x", **env})


def test_a_zeroed_progress_record_is_no_record_and_a_new_writer_never_zeroes(
    tmp_path: Path,
) -> None:
    path = progress_path(tmp_path, 1)
    path.write_bytes(b"\0" * 64)  # created, not written yet (e.g. read between two syscalls)
    r = ProgressReader(tmp_path)
    assert r.read(1) is None and r.read_all() == {}  # not "frozen since 1970"
    w = ProgressWriter(path, heartbeat_interval_s=60)
    w.step_end(41, 0.1)
    w.close()
    fd = os.open(path, os.O_RDONLY)
    try:
        before = os.read(fd, 64)
        w2 = ProgressWriter(path, heartbeat_interval_s=60)  # a restarted worker, same rank
        try:
            # the file was never truncated: its size and the old record stayed until replaced
            assert path.stat().st_size == 64 and before[:8] != b"\0" * 8
            assert r.read(1) is not None and r.read(1).pid == os.getpid()
        finally:
            w2.close()
    finally:
        os.close(fd)


def test_worker_telemetry_settings_come_from_the_agents_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker reads [telemetry] as it reads every section: the agent's config.json when
    there is one, else the environment; a bad value falls back to the defaults."""
    from trainguard.core.config import worker_section_or_default
    from trainguard.core.config.telemetry import TelemetryConfig

    def _telemetry_settings(run_dir: Path) -> TelemetryConfig:  # as the worker reads it
        return worker_section_or_default(run_dir, "telemetry")

    section = {"trace_every_n_steps": 3, "flush_interval_s": 0.05}
    (tmp_path / "config.json").write_text(json.dumps({"trainguard": {"telemetry": section}}))
    monkeypatch.setenv("TRAINGUARD_TELEMETRY_TRACE_EVERY_N_STEPS", "7")
    cfg = _telemetry_settings(tmp_path)
    assert (cfg.trace_every_n_steps, cfg.flush_interval_s) == (3, 0.05)
    plain = tmp_path / "plain"  # no config.json: plain torchrun or python
    plain.mkdir()
    assert _telemetry_settings(plain).trace_every_n_steps == 7
    monkeypatch.setenv("TRAINGUARD_TELEMETRY_FLUSH_INTERVAL_S", "0")
    assert _telemetry_settings(plain) == TelemetryConfig()
