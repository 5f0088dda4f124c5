"""Hang diagnosis: plain torch.distributed scripts (no trainguard import) under `trainguard run`,
one rank on another code path or stopped; the verdict names the collective and the ranks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.health_fixtures.jobs import events, job_env, wait_for_event
from tests.launch_utils import free_port
from tests.procs import kill_tree
from trainguard.core.flight_recorder import CollectiveState, parse_trace
from trainguard.health.hangdiag import RankDump, analyse
from trainguard.health.stacktext import aggregate_stacks, main_frame

pytestmark = pytest.mark.xdist_group("hang")

SCRIPT = Path(__file__).resolve().parent / "workers" / "plain_collectives.py"
PG = "0:default_pg"


def _cmd(run_dir: Path, nproc: int, args: list[str], *, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "trainguard", "run", "--nproc-per-node", str(nproc),
        "--monitor-interval", "0.1", "--tg-run-dir", str(run_dir), *extra, str(SCRIPT), *args,
    ]  # fmt: skip


def _kill_workers(cwd: Path) -> None:
    for f in (cwd / "pids").glob("*"):
        try:
            os.kill(int(f.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _dump(
    rank: int, op: str | None, entered: int, completed: int, host: str = "h", path: str = ""
) -> RankDump:
    """``path``: the ops of the collectives from #60 on, one letter each (a: all_reduce,
    b: broadcast), the last one ``op``."""
    names = {"a": "all_reduce", "b": "broadcast"}
    hist = [[60 + i, names[c]] for i, c in enumerate(path)]
    st = CollectiveState(PG, entered, completed, op, [[16]], hist)
    return RankDump(rank, host, "flight_recorder", {PG: st.to_json()})


# -- logic -------------------------------------------------------------------------------------
def test_parse_trace_reads_last_entered_and_completed() -> None:
    entry = {"process_group": ["0", "default_pg"], "is_p2p": False, "input_sizes": [[16]]}
    trace = {
        "entries": [
            {**entry, "collective_seq_id": 61, "profiling_name": "gloo:all_reduce"},
            {**entry, "collective_seq_id": 62, "profiling_name": "gloo:broadcast"},
        ],
        "pg_status": {"0": {"last_enqueued_collective": "62", "last_completed_collective": "61"}},
    }
    [(pg, s)] = parse_trace(trace).items()
    assert pg == PG and (s.op, s.entered, s.completed, s.in_flight) == ("broadcast", 62, 61, True)
    assert s.history == [[61, "all_reduce"], [62, "broadcast"]]


def test_analyse_classifies_missing_divergent_transport() -> None:
    missing = {r: _dump(r, "all_reduce", 7, 6, "a" if r < 2 else "b") for r in range(3)}
    missing[3] = _dump(3, None, 6, 6, "b")
    d = analyse(missing, 4)
    assert (d.kind, d.op, d.seq, d.suspect_ranks, d.suspect_hosts) == (
        "missing", "all_reduce", 7, [3], ["b"]
    )  # fmt: skip
    assert "rank 3 on b" in d.message and "never entered" in d.message
    div = {r: _dump(r, "broadcast", 62, 61) for r in (0, 2, 3)}
    div[1] = _dump(1, "all_reduce", 62, 61)
    d = analyse(div, 4)
    assert d.kind == "divergent" and d.suspect_ranks == [1]
    assert d.message.startswith("ranks split: {0,2,3} in broadcast #62, {1} in all_reduce #62")
    # gloo: the broadcast's root sends and goes on, so rank 2 finished #62 and waits in #63;
    # the traces' common history still names the split at #62
    gloo = {r: _dump(r, "broadcast", 62, 61, path="abb") for r in (0, 3)}
    gloo[1] = _dump(1, "all_reduce", 62, 61, path="aba")
    gloo[2] = _dump(2, "all_reduce", 63, 62, path="abba")
    d = analyse(gloo, 4)
    assert (d.kind, d.op, d.seq, d.suspect_ranks) == ("divergent", "broadcast", 62, [1])
    assert d.message.startswith(
        "ranks split: {0,2,3} in broadcast #62, {1} in all_reduce #62 (divergent code path); "
        "rank 2 got past it, now in all_reduce #63"
    ), d.message
    d = analyse({r: _dump(r, "all_gather", 3, 2) for r in range(4)}, 4)
    assert d.kind == "transport" and d.seq == 3
    stale = {r: _dump(r, "all_reduce", 11, 10) for r in range(3)}
    stale[3] = RankDump(3, "h", "progress", {PG: CollectiveState(PG, 3, 2).to_json()},
                        process_state="T")  # stopped; its record is older than its stop # fmt: skip
    d = analyse(stale, 4)
    assert d.kind == "missing" and d.suspect_ranks == [3], d.message
    assert "rank 3 on h (last seen after #2) (process stopped) never entered" in d.message
    d = analyse({0: _dump(0, "all_gather", 3, 2)}, 2)  # rank 1 sent nothing
    assert d.kind == "missing" and d.suspect_ranks == [1] and d.missing_dumps == [1]


def test_identical_stacks_aggregate_and_main_frame_skips_libraries() -> None:
    def fh(tid: str, line: int) -> str:
        return (
            f"Thread 0x{tid} (most recent call first):\n"
            '  File "/x/torch/distributed/distributed_c10d.py", line 3151 in broadcast\n'
            f'  File "/job/train.py", line {line} in <module>\n'
        )

    stacks = {r: fh(f"{r:012x}", 40) for r in range(6)}
    stacks[4] = fh("0000000000ff", 38)
    groups = aggregate_stacks(stacks)
    assert [g["ranks"] for g in groups] == [[0, 1, 2, 3, 5], [4]]
    assert groups[0]["stack"].startswith("Thread 0x? (most recent call first):")
    pyspy = {r: f'Thread {1000 + r} (idle): "MainThread"\n    wait (x.py:3)\n' for r in (7, 8)}
    assert [g["ranks"] for g in aggregate_stacks(pyspy)] == [[7, 8]]
    assert main_frame(stacks[4]) == "<module> (train.py:38)"


# -- real jobs ---------------------------------------------------------------------------------
def test_plain_script_divergent_path_is_named_and_job_restarts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # symlinks planted at the agent's hang-dump names (and the old fixed temporary names):
    # every write replaces them, none writes through them
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    planted = run_dir / "hangs" / "0"
    planted.mkdir(parents=True)
    for name in ("diagnosis.json", "diagnosis.json.tmp", "pyspy_rank_1.txt.tmp"):
        (planted / name).symlink_to(victim)
    # three ranks: a majority of two in the broadcast, rank 1 alone in its extra all_reduce
    cmd = _cmd(run_dir, 3, ["--diverge-rank", "1", "--at-step", "30"],
               extra=["--standalone", "--max-restarts", "1"])  # fmt: skip
    # a collective timeout set above the hang timeout: the launch warns in one line
    env = job_env(hang_timeout_s=5, collective_timeout_s=1800)
    try:
        p = subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=150, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        _kill_workers(tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if "timeouts contradict" in ln]
    assert len(lines) == 1, lines
    assert "health.collective_timeout_s" in lines[0] and "health.hang_timeout_s" in lines[0]
    chain = json.loads((run_dir / "config.json").read_text())["timeouts"]
    assert [c["name"] for c in chain] == ["collective", "hang", "rendezvous"]
    [diag] = events(run_dir, "hang_diagnosis")
    assert diag["diagnosis"] == "divergent", diag["message"]
    seq = diag["seq"]
    assert diag["message"].startswith(
        f"ranks split: {{0,2}} in broadcast #{seq}, {{1}} in all_reduce #{seq} "
    ), diag["message"]
    assert diag["suspect_ranks"] == [1] and diag["op"] == "broadcast"
    hang_at = float((tmp_path / "hang_at").read_text())
    assert diag["time"] - hang_at <= 5 + 5, diag["time"] - hang_at
    assert events(run_dir, "collective_progress")
    assert "hang diagnosis (divergent): ranks split:" in p.stderr
    assert p.stderr.count("judged by their collectives") == 2  # one line per attempt
    hang_dir = run_dir / "hangs" / "0"
    assert {f"fr_rank_{r}.json" for r in range(3)} <= {f.name for f in hang_dir.iterdir()}
    assert (hang_dir / "diagnosis.json").is_file()
    assert not (hang_dir / "diagnosis.json").is_symlink() and victim.read_text() == "untouched\n"
    assert len(events(run_dir, "restart")) == 1 and (tmp_path / "done").read_text() == "60"
    # the HTML report has the verdict, the groups and the aggregated stacks (written in this
    # process: test_report_chromium and test_planted_files run the ``trainguard report`` CLI)
    from trainguard.telemetry.report import write_report

    html = write_report(run_dir, tmp_path / "report.html").read_text()
    hangs = html.split('<div id="hangs">')[1].split("</div>")[0]
    assert (
        "ranks split: " in hangs and "stack of ranks" in hangs and "plain_collectives.py" in hangs
    )
    assert "health.hang_timeout_s" in html.split('<div id="timeouts">')[1]


def _two_nodes(
    tmp_path: Path,
    args: list[str],
    nproc: int = 2,
    hang_timeout_s: float = 5,
    port: int = 0,
    **health: object,
) -> tuple[list[subprocess.Popen[str]], Path]:
    run_dir, port = tmp_path / "run", port or free_port()
    procs = []
    for node in ("nodeA", "nodeB"):
        env = job_env(hang_timeout_s=hang_timeout_s, **health)
        env["SLURMD_NODENAME"] = node
        extra = ["--nnodes", "2", "--max-restarts", "0", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hd"]  # fmt: skip
        procs.append(
            subprocess.Popen(
                _cmd(run_dir, nproc, args, extra=extra),
                cwd=tmp_path,
                env=env,
                text=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=open(tmp_path / f"{node}.err", "w"),
            )  # fmt: skip
        )
    return procs, run_dir


def test_two_nodes_stopped_rank_named_with_its_host_and_collective(tmp_path: Path) -> None:
    """Two nodes of three ranks, rank 4 stopped: each node's verdict names the rank, its host and
    the collective, and groups the stacks of all six ranks into a few (the 64-rank version:
    test_sixty_four_ranks_one_stopped_few_stack_groups, a soak test). Three ranks a node, not
    four: one worker (a torch import) fewer per node; the stopped rank is still on the second node, with
    ranks of both nodes waiting for it."""
    procs, run_dir = _two_nodes(
        tmp_path, ["--stop-rank", "4", "--at-step", "20"], nproc=3,
        hang_diagnosis_timeout_s=20, stack_dump="false",
    )  # fmt: skip
    try:
        diags = wait_for_event(run_dir, "hang_diagnosis", timeout=90, count=2)
        for p in procs:
            p.wait(timeout=60)
    finally:
        _kill_workers(tmp_path)
        for p in procs:
            kill_tree(p)
    hang_at = float((tmp_path / "hang_at").read_text())
    started = events(run_dir, "workers_started")
    host4 = next(e["node"] for e in started for w in e["workers"] if w["rank"] == 4)
    for d in diags:
        assert d["diagnosis"] == "missing", d["message"]
        assert d["suspect_ranks"] == [4] and d["suspect_hosts"] == [host4]
        assert d["op"] in ("all_reduce", "broadcast") and isinstance(d["seq"], int)
        assert f"{d['op']} #{d['seq']}" in d["message"]
        assert f"rank 4 on {host4}" in d["message"]
        # typically two groups: the five waiting ranks and the stopped one
        assert 1 <= len(d["stack_groups"]) <= 4, [g["ranks"] for g in d["stack_groups"]]
        assert sum(len(g["ranks"]) for g in d["stack_groups"]) == 6
    first = min(d["time"] for d in diags)
    assert first - hang_at <= 5 + 3, first - hang_at
    assert {d["node"] for d in diags} == {"nodeA", "nodeB"}


@pytest.mark.parametrize("how", ["failed", "lost"])
def test_survivors_of_a_dead_peer_node_are_released_at_once(tmp_path: Path, how: str) -> None:
    """Rank 1 dies without its connections closing, so rank 0 (the other node) waits in an
    all_reduce no error ends before the process-group timeout (30 min). ``failed``: rank 1
    SIGKILLed, a child holds its connections; its agent fails and says so in the rendezvous
    store. ``lost``: rank 1 and its agent SIGSTOPped (a frozen or cut-off node); its liveness
    beacon stands still. Either way the other agent ends rank 0 at once: before its own hang
    timeout could fire."""
    if how == "failed":
        args = ["--kill-rank", "1", "--keep-sockets"]
    else:
        args = ["--stop-rank", "1", "--stop-node"]
    args += ["--at-step", "10", "--step-s", "0.05"]
    # the rendezvous store is hosted here, as by a node that stays (a frozen agent hosting it
    # would stall every agent's store reads)
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    procs, run_dir = _two_nodes(tmp_path, args, nproc=1, hang_timeout_s=10, port=port)
    try:
        deadline = time.monotonic() + 120
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        if how == "failed":
            for p in procs:
                p.wait(timeout=30)
    finally:
        _kill_workers(tmp_path)
        for p in procs:
            kill_tree(p)
        del store
        for f in (tmp_path / "pids").glob("*"):
            _reaped(f)
    assert not (tmp_path / "released_rank_0").exists()  # no error reached it: sockets open
    failed = {e["rank"]: e for e in events(run_dir, "worker_failed")}
    assert failed[0]["signal"] == "SIGKILL"
    [peer] = events(run_dir, "peer_failed")
    assert peer["how"] == how and peer["ranks"] == [0] and peer["node"] == failed[0]["node"]
    if how == "failed":
        assert (tmp_path / "pids" / "holder_1").is_file()
        assert failed[1]["signal"] == "SIGKILL" and peer["failed_node"] == failed[1]["node"]
    assert not events(run_dir, "hang_detected")  # released by the failure, not by a timeout


def _reaped(pid_file: Path) -> None:
    """Wait (briefly) until a killed worker or holder is gone (its parent died before it:
    this process may be the one to reap it)."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)  # this process may be its reaper (a subreaper)
        except ChildProcessError:
            pass
        time.sleep(0.05)


def _stopped_one_of_many(tmp_path: Path, nproc: int, stop: int) -> None:
    run_dir = tmp_path / "run"
    cmd = _cmd(run_dir, nproc, ["--stop-rank", str(stop), "--at-step", "5", "--steps", "30"],
               extra=["--standalone", "--max-restarts", "0"])  # fmt: skip
    env = job_env(hang_timeout_s=8, hang_diagnosis_timeout_s=20, stack_dump="false")
    try:
        subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        _kill_workers(tmp_path)
    [diag] = events(run_dir, "hang_diagnosis")
    assert diag["diagnosis"] == "missing" and diag["suspect_ranks"] == [stop], diag["message"]
    assert 1 <= len(diag["stack_groups"]) <= 5, [g["ranks"] for g in diag["stack_groups"]]
    assert sum(len(g["ranks"]) for g in diag["stack_groups"]) == nproc


@pytest.mark.soak
def test_sixty_four_ranks_one_stopped_few_stack_groups(tmp_path: Path) -> None:
    _stopped_one_of_many(tmp_path, 64, 37)


def _completed_seq(run_dir: Path, rank: int) -> int:
    from trainguard.core.flight_recorder import collective_progress_path
    from trainguard.core.progress import ProgressReader

    path = collective_progress_path(run_dir / "progress" / "attempt_0", rank)
    snap = ProgressReader(path.parent).read_path(path)
    return snap.step if snap else -1


def _rate(run_dir: Path, seconds: float = 2.0) -> float:
    a, t0 = _completed_seq(run_dir, 0), time.monotonic()
    time.sleep(seconds)
    return (_completed_seq(run_dir, 0) - a) / (time.monotonic() - t0)


def test_debug_shows_a_running_job_without_slowing_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = _cmd(run_dir, 2, ["--steps", "100000", "--step-s", "0.05"],
               extra=["--standalone", "--max-restarts", "0"])  # fmt: skip
    job = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(), stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 180  # start-up on a loaded host
        while _completed_seq(run_dir, 0) < 40 or _completed_seq(run_dir, 1) < 40:
            assert time.monotonic() < deadline and job.poll() is None, "job did not start"
            time.sleep(0.2)
        before = _rate(run_dir)
        outs = {}
        for view, extra, n in (("stacks", [], 2), ("collectives", ["--ranks", "1"], 1)):
            t0 = time.monotonic()
            p = subprocess.run(
                [sys.executable, "-m", "trainguard", "debug", str(run_dir), view, *extra],
                capture_output=True, text=True, timeout=30, env=job_env(),
            )  # fmt: skip
            elapsed = time.monotonic() - t0
            assert p.returncode == 0, p.stderr
            m = re.search(rf"\((\d+) of {n} ranks answered in ([\d.]+)s", p.stdout)
            assert m and m[1] == str(n) and float(m[2]) <= 5.0, p.stdout[-300:]
            assert elapsed <= 20.0, elapsed  # interpreter start-up on a loaded host included
            outs[view] = p.stdout
        after = _rate(run_dir)
        assert job.poll() is None  # still running
    finally:
        kill_tree(job)
        _kill_workers(tmp_path)
    assert "plain_collectives.py" in outs["stacks"] and "no answer" not in outs["stacks"]
    assert "=== ranks {0,1} (2) ===" in outs["stacks"] or outs["stacks"].count("=== ranks") == 2
    assert "ranks {1}: pg 0:default_pg" in outs["collectives"] and "{0" not in outs["collectives"]
    assert "main thread at" in outs["collectives"]
    assert after >= 0.7 * before, (before, after)


# -- the timeout chain -------------------------------------------------------------------------
def test_timeout_chain_flags_only_user_settings_in_the_wrong_order() -> None:
    from trainguard.core.config import TrainGuardConfig
    from trainguard.core.config.health import HealthConfig
    from trainguard.core.timeouts import contradictions, timeout_chain

    cfg = TrainGuardConfig(health=HealthConfig(hang_timeout_s=300))
    chain = timeout_chain(cfg)
    assert [(c.name, c.value_s, c.source) for c in chain] == [
        ("collective", 1800.0, "default"), ("hang", 300, "set"), ("rendezvous", 600.0, "default")
    ]  # fmt: skip
    assert contradictions(chain) == []  # torch's default is not the user's choice
    cfg = TrainGuardConfig(health=HealthConfig(hang_timeout_s=300, collective_timeout_s=1800))
    [line] = contradictions(timeout_chain(cfg, rdzv_configs={"join_timeout": 3600}))
    assert "health.collective_timeout_s = 1800s" in line and "health.hang_timeout_s = 300s" in line
    ok = TrainGuardConfig(health=HealthConfig(hang_timeout_s=300, collective_timeout_s=120))
    assert contradictions(timeout_chain(ok, rdzv_configs={"join_timeout": 900})) == []


def test_watcher_records_collective_progress_and_the_timeout_follows_its_cadence(
    tmp_path: Path,
) -> None:
    from trainguard.core.config.health import HealthConfig
    from trainguard.core.contracts import envvars
    from trainguard.core.flight_recorder import FR_BUFFER_ENV, collective_progress_path
    from trainguard.core.progress import ProgressReader
    from trainguard.health.hang import HangTracker

    code = (
        "import time, torch, torch.distributed as dist\n"
        "from trainguard.core.flight_recorder import start_in_worker\n"
        "start_in_worker()\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0,"
        " world_size=1)\n"
        "t = torch.ones(4)\n"
        "for i in range(12):\n"
        "    dist.all_reduce(t)\n"
        "    time.sleep(0.4)\n"
        "    if i == 8:  # the agent's no-py-spy stack dump: a dump, not the end\n"
        "        import os, signal; os.kill(os.getpid(), signal.SIGUSR2)\n"
        "dist.destroy_process_group()\n"
    )
    # the watcher's cadence comes from the run's config.json, as the agent writes it
    sections = {"health": {"collective_poll_interval_s": 0.05}, "runtime": {}}
    (tmp_path / "config.json").write_text(json.dumps({"trainguard": sections}))
    env = job_env()
    env.update({FR_BUFFER_ENV: "100", "RANK": "0",
                envvars.PROGRESS_DIR: str(tmp_path), envvars.RUN_DIR: str(tmp_path)})  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    path = collective_progress_path(tmp_path, 0)
    snap = ProgressReader(tmp_path).read_path(path)
    assert snap is not None and snap.step == 12 and snap.num_steps >= 10  # seq ids 1..12
    assert snap.heartbeat == float("inf")  # closed when the group was destroyed: finishing
    assert 0.3 <= snap.last_step_s <= 1.0, snap.last_step_s  # the cadence, ~0.4 s
    fh = (tmp_path / "stacks" / "attempt_0" / "rank_0.faulthandler.txt").read_text()
    assert "<string>" in fh  # the main thread's frames; the process lived on (rc 0)
    tracker = HangTracker(HealthConfig(hang_min_timeout_s=0.1, hang_warmup_steps=0))
    tracker._learn({0: snap})
    assert tracker.step_timeout() == pytest.approx(5 * snap.last_step_s)


def test_the_hang_dump_layout_is_spelled_once_and_the_analysis_is_pure() -> None:
    """RunDir / DumpDir spell every hang and debug path; the watcher, the agent's collection
    and ``trainguard debug`` ask them. The analysis modules read no file, store or process."""
    import ast

    from trainguard.core.contracts.rundir import RunDir

    pkg = Path(__file__).resolve().parents[1] / "trainguard"
    names = ("fr_rank_", "stacks_rank_", "pyspy_rank_", "summary_rank_", "faulthandler.txt")
    spelled = [
        f"{p.relative_to(pkg)}: {n}"
        for p in pkg.rglob("*.py")
        if p.name != "rundir.py"
        for n in names
        if n in p.read_text()
    ]
    assert spelled == []
    for mod in ("health/hangdiag.py", "health/stacktext.py"):
        imported = {
            alias.name if isinstance(node, ast.Import) else str(node.module)
            for node in ast.walk(ast.parse((pkg / mod).read_text()))
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        io = {
            "os",
            "time",
            "json",
            "trainguard.core.atomicfile",
            "trainguard.core.contracts.rundir",
        }
        assert not imported & io, (mod, imported & io)
    rd = RunDir("/r")
    hang, debug = rd.hang(3), rd.debug("x")
    assert hang.path == Path("/r/hangs/3") and debug.path == Path("/r/debug/x")
    assert hang.request("n1").name == "request.n1" and debug.request().name == "request"
    assert [m for _, m in hang.stack_files(2)] == ["faulthandler", "py-spy"]
    assert rd.signal_stacks(0, 1).parent == rd.stacks(0) == rd.hung_stack(0, 1).parent
