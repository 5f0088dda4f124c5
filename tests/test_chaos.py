"""Chaos tooling: the TRAINGUARD_CHAOS spec, and real faults in real processes.

- a 1-rank ``trainguard run`` job with ``kill:rank=0,step=6;hang:rank=0,step=12,attempt=1``: the
  rank dies by SIGKILL in attempt 0, freezes (SIGSTOP) in attempt 1, the hang detector names it,
  attempt 2 finishes; then ``trainguard chaos corrupt-checkpoint`` flips bytes in the newest
  checkpoint and a resumed job falls back to the older one, reporting the bad one (one rank: a
  rank's faults are its own; the spec's selection of ranks and attempts in multi-rank jobs is
  tests/test_integrations_hf.py's and test_integrations_lightning.py's, ``hang:rank=1`` /
  ``kill:rank=0,...,attempt=1`` on 2 ranks);
- ``trainguard chaos dcgm``: a dcgm-exporter endpoint the health source scrapes, healthy until
  its trigger file exists, then XID 79 (a ``fail`` verdict);
- ``trainguard chaos kill-rank`` / ``pause`` on real processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.health_fixtures.jobs import events
from tests.launch_utils import REPO, base_env, steps_done
from tests.procs import alive, kill_tree
from trainguard.chaos import faults as chaos
from trainguard.core.config.health import HealthConfig

EXAMPLE = str(REPO / "examples" / "train_mlp.py")
# the job's worker: the example without the DDP wrapper (--no-ddp; the chaos faults, the hang
# detector and the checkpoint fallback are the subject, not DDP; DDP's import is ~2 CPU s a
# worker start)
CHAOS = [sys.executable, "-m", "trainguard", "chaos"]


# -- the spec ---------------------------------------------------------------------------------
def test_spec_parsing_and_selection() -> None:
    faults = chaos.parse_spec(
        "kill:rank=1,step=40; hang:rank=0,step=60,attempt=*,mode=sleep;"
        "slow:rank=1,factor=3,step=5;exit:after=2.5s,code=4;kill:step=1,signal=term,node=n1"
    )
    kill, hang, slow, exit_, term = faults
    assert (kill.kind, kill.rank, kill.step, kill.attempt, kill.signal) == (
        "kill", 1, 40, 0, signal.SIGKILL,
    )  # fmt: skip
    assert hang.attempt is None and hang.mode == "sleep"
    assert slow.factor == 3 and slow.step == 5
    assert exit_.rank is None and exit_.after_s == 2.5 and exit_.code == 4
    assert term.signal == signal.SIGTERM and term.node == "n1"
    # selection by rank, attempt (default 0 only) and node
    assert kill.applies(rank=1, attempt=0, node="x") and not kill.applies(
        rank=1, attempt=1, node="x"
    )
    assert hang.applies(rank=0, attempt=7, node=None)
    assert not term.applies(rank=0, attempt=0, node="n2")
    w = chaos.WorkerChaos(faults, rank=1, attempt=1, node="n1")
    assert [f.kind for f in w.faults] == []  # kill/slow/exit/term are attempt 0, hang is rank 0
    w = chaos.WorkerChaos(chaos.parse_spec("slow:delay=0.05,step=2"), rank=3, attempt=0, node=None)
    t0 = time.monotonic()
    w.step_body_done(1, 0.0)  # before step 2: no delay
    w.step_body_done(2, 0.0)
    assert time.monotonic() - t0 >= 0.05

    for bad, what in (
        ("kill:rank=1", "exactly one of step=S or after"),
        ("nuke:rank=1,step=1", "unknown fault 'nuke'"),
        ("slow:rank=1", "factor=F"),
        ("slow:factor=0.5", "factor='0.5'"),
        ("kill:step=x", "step='x'"),
        ("kill:step=1,signal=NOPE", "signal='NOPE'"),
        ("hang:step=1,mode=nap", "mode='nap'"),
        ("kill:step=1,colour=red", "not 'colour'"),
        ("kill:step", "not key=value"),
        (" ; ", "no fault"),
    ):
        with pytest.raises(chaos.ChaosSpecError, match=what) as info:
            chaos.parse_spec(bad)
        assert "\n" not in str(info.value) and chaos.CHAOS_ENV in str(info.value)


# torch's error handler enables faulthandler on stderr, which pytest's capture has no fd for
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_bad_spec_stops_the_launch_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process, through the entry point the command runs (tests/test_run_badinput.py
    launches the command for real for this family: a launch stopped in one line)."""
    from trainguard.cli.main import main

    monkeypatch.chdir(tmp_path)
    for k in list(os.environ):
        if k.startswith(("PET_", "TORCHELASTIC_", "TRAINGUARD_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("TRAINGUARD_CHAOS", "kill:rank=one,step=3")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--standalone", "--nproc-per-node", "1", "--tg-run-dir",
              str(tmp_path / "run"), EXAMPLE])  # fmt: skip
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "rank='one'" in lines[0] and "Traceback" not in err, err


# -- a real job: kill, hang, then a corrupt checkpoint ------------------------------------------
def _job(run_dir: Path, steps: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "1",
        "--max-restarts", "2", "--monitor-interval", "0.1", "--tg-run-dir", str(run_dir),
        EXAMPLE, "--no-ddp", "--steps", str(steps), "--ckpt-every", "5", "--step-sleep", "0.05",
    ]  # fmt: skip
    p = subprocess.Popen(
        cmd, cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = p.communicate(timeout=240)
    finally:
        kill_tree(p.pid)  # SIGSTOPped workers included
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


@pytest.mark.slow
def test_kill_and_hang_spec_then_corrupt_checkpoint_falls_back(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = base_env(
        TRAINGUARD_CHAOS="kill:rank=0,step=6;hang:rank=0,step=12,attempt=1",
        TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0",
        TRAINGUARD_HEALTH_HANG_TIMEOUT_S="4",
        TRAINGUARD_TELEMETRY_ENABLED="false",
    )
    p = _job(run_dir, 20, env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "trainguard chaos: rank 0: kill -KILL at step 6, attempt 0 (this is rank 0" in p.stderr
    failed = events(run_dir, "worker_failed")
    killed = [e for e in failed if e["rank"] == 0 and e["attempt"] == 0 and e["root_cause"]]
    assert killed and killed[0]["signal"] == "SIGKILL", failed
    [hang] = events(run_dir, "hang_detected")
    assert hang["attempt"] == 1 and hang["ranks"] == [0] and hang["hang_kind"] == "frozen"
    assert {e["attempt"] for e in events(run_dir, "workers_started")} == {0, 1, 2}
    assert steps_done(run_dir) == 19

    # the newest committed checkpoint (step 20) gets flipped bytes; a resumed run that reads
    # from disk (memory tier off) reports it and falls back to step 15
    r = subprocess.run(
        [*CHAOS, "corrupt-checkpoint", str(run_dir)],
        env=base_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0 and "(step 20)" in r.stdout, r.stderr
    env2 = base_env(
        TRAINGUARD_CHECKPOINT_MEMORY_TIER="false",
        TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0",
        TRAINGUARD_TELEMETRY_ENABLED="false",
    )
    p = _job(run_dir, 22, env2)
    assert p.returncode == 0, p.stderr[-3000:]
    [corrupt] = [e for e in events(run_dir, "checkpoint_corrupt") if e["step"] == 20]
    assert "crc" in corrupt["error"].lower() or "checksum" in corrupt["error"].lower(), corrupt
    restored = [e for e in events(run_dir, "checkpoint_restored") if e["attempt"] == 0]
    assert [(e["step"], e["source"]) for e in restored[-1:]] == [(15, "disk")], restored


# -- dcgm-exporter endpoint scraped by the health source -----------------------------------------
def test_dcgm_endpoint_turns_to_xid_79(tmp_path: Path) -> None:
    from trainguard.health.dcgm_exporter import DcgmExporterSource
    from trainguard.health.policy import Policy

    trigger, port_file = tmp_path / "fail-now", tmp_path / "port"
    p = subprocess.Popen(
        [*CHAOS, "dcgm", "--port", "0", "--port-file", str(port_file),
         "--xid", "79", "--gpu", "3", "--trigger-file", str(trigger)],
        env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()  # type: ignore[union-attr]
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text()}/metrics"
        cfg = HealthConfig()
        source = DcgmExporterSource(cfg, Policy(), url=url)
        before = source.probe()
        assert before.status.value == "ok", before
        trigger.touch()
        after = source.probe()
        assert after.status.value == "fail" and after.action.value == "drain", after
        assert "79" in " ".join(str(x) for x in after.reasons), after
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


# -- pause / kill-agent on real processes ------------------------------------------------------------
def test_pause_by_port_and_kill_agent_tree(tmp_path: Path) -> None:
    from trainguard.testing.ports import free_port

    port = free_port()
    pause: subprocess.Popen[str] | None = None
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        from trainguard.chaos.ops import listening_pids

        deadline = time.monotonic() + 30
        while server.pid not in listening_pids(port):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        pause = subprocess.Popen(
            [*CHAOS, "pause", "--endpoint", f"127.0.0.1:{port}", "--seconds", "1.5"],
            env=base_env(), stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert "stopped" in (pause.stdout.readline() if pause.stdout else "")
        states = []
        while pause.poll() is None:  # the server is stopped (T) until pause SIGCONTs it
            states.append(_state(server.pid))
            time.sleep(0.05)
        out = pause.stdout.read() if pause.stdout else ""
        assert pause.returncode == 0 and "resumed" in out
        assert "T" in states and _state(server.pid) != "T", states
        # kill-agent --pid: the process and everything under it
        r = subprocess.run(
            [*CHAOS, "kill-agent", "--pid", str(server.pid)],
            env=base_env(), capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        server.wait(timeout=30)
        assert not alive(server.pid)
    finally:
        for proc in (server, pause):
            if proc is not None:
                kill_tree(proc.pid)
                proc.wait()


def test_throttle_stops_a_process_most_of_the_time_and_always_continues_it() -> None:
    """``throttle(pid, 0.25)`` holds a busy process to about a quarter of a core by stopping
    and continuing it (every burst slowed, however short), and leaves it running, never
    stopped, when the block ends; a share outside (0, 1) is refused."""
    from tests.throttle import throttle

    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:

        def cpu_s() -> float:
            f = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

        c0, t0 = cpu_s(), time.monotonic()
        with throttle(p.pid, share=0.25) as how:
            time.sleep(2.0)
        share = (cpu_s() - c0) / (time.monotonic() - t0)
        assert how == "signals"
        assert share < 0.5, share  # a quarter (less on a busy machine), never a whole core
        state = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state in ("R", "S"), state  # continued, not left stopped
        with pytest.raises(ValueError, match="between 0 and 1"):
            with throttle(p.pid, share=1.5):
                pass
    finally:
        kill_tree(p)
