"""``trainguard chaos`` signals only what is verifiably the job's, on real processes: a pid
written into events.jsonl that is not a process of one of the job's agents (an agent holds the
run directory's agent mark open, is run by its owner, is neither init nor the caller or one of
its ancestors, and started when its ``launch`` event says; a worker is in the process tree of
its node's agent) is refused with one line and stays alive, even with a forged ``launch`` line
carrying its real start time; ``pause --endpoint HOST:PORT`` acts only on a listener of that
host. (The agents here are stand-ins holding the mark; a real agent is signalled through
``kill-agent --group-rank`` in test_rdzv_etcd.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch_utils import base_env
from tests.procs import alive, descendants, kill_tree
from trainguard.core.events import node_name
from trainguard.core.proctime import process_start_time
from trainguard.testing.ports import free_port

CHAOS = [sys.executable, "-m", "trainguard", "chaos"]
# an agent's stand-in: holds the run directory's agent mark (as trainguard.runtime.launcher does)
# and starts a child standing in for a worker
SPAWNER = (
    "import subprocess, sys, time; from trainguard.core.agentmark import hold_mark; "
    "assert hold_mark(sys.argv[1]) is not None; subprocess.Popen(['sleep', '600']); time.sleep(600)"
)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        kill_tree(p.pid)
        p.wait(timeout=30)


def _start(procs: list[subprocess.Popen[bytes]], *argv: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(list(argv), start_new_session=True, stdin=subprocess.DEVNULL)
    procs.append(p)
    return p


def _agent_with_worker(procs: list[subprocess.Popen[bytes]], run_dir: Path) -> tuple[int, int]:
    """A process standing in for an agent of ``run_dir`` and its child standing in for a worker."""
    run_dir.mkdir(exist_ok=True)
    agent = _start(procs, sys.executable, "-c", SPAWNER, str(run_dir))
    deadline = time.monotonic() + 60
    while not descendants(agent.pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return agent.pid, descendants(agent.pid)[0]


def _run_dir(tmp_path: Path, *events: dict) -> Path:
    d = tmp_path / "run"
    d.mkdir(exist_ok=True)
    with open(d / "events.jsonl", "a") as f:
        for ev in events:
            f.write(json.dumps({"time": time.time(), "node": node_name(), **ev}) + "\n")
    return d


def _chaos(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CHAOS, *args], env=base_env(), capture_output=True, text=True, timeout=120
    )


def test_kill_rank_signals_the_jobs_worker_only(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    agent, worker = _agent_with_worker(procs, tmp_path / "run")
    bystander = _start(procs, "sleep", "600").pid  # any process whose pid got into the log
    run_dir = _run_dir(
        tmp_path,
        {"kind": "launch", "pid": agent, "process_start": process_start_time(agent)},
        {"kind": "workers_started", "workers": [{"rank": 0, "pid": bystander},
                                                 {"rank": 1, "pid": worker}]},
    )  # fmt: skip
    r = _chaos("kill-rank", str(run_dir), "--rank", "0")
    assert r.returncode == 2 and "not signalled" in r.stderr, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    time.sleep(0.3)
    assert alive(bystander)
    r = _chaos("kill-rank", str(run_dir), "--rank", "1")
    assert r.returncode == 0 and f"pid {worker}" in r.stdout, r.stderr
    deadline = time.monotonic() + 30
    while alive(worker):
        assert time.monotonic() < deadline, "the job's worker was not killed"
        time.sleep(0.05)
    assert alive(agent) and alive(bystander)


def test_kill_agent_checks_the_recorded_start_time(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    agent, _ = _agent_with_worker(procs, tmp_path / "run")
    bystander = _start(procs, "sleep", "600").pid
    members = [{"node": node_name(), "pid": bystander}, {"node": node_name(), "pid": agent}]
    run_dir = _run_dir(
        tmp_path,
        # the pid of an agent that ended, reused since by another process: its start differs
        {"kind": "launch", "pid": bystander, "process_start": time.time() - 3600},
        {"kind": "launch", "pid": agent, "process_start": process_start_time(agent)},
        {"kind": "rendezvous", "members": members},
    )
    for who in (["--group-rank", "0"], ["--node", "elsewhere"]):
        r = _chaos("kill-agent", str(run_dir), *who)
        assert r.returncode == 2, r.stdout + r.stderr
    time.sleep(0.3)
    assert alive(bystander) and alive(agent)
    r = _chaos("kill-agent", str(run_dir), "--group-rank", "1")
    assert r.returncode == 0 and f"killed agent {agent}" in r.stdout, r.stderr
    deadline = time.monotonic() + 30
    while alive(agent):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert alive(bystander)


# the caller's parent as the "agent": it holds the mark, its launch line carries its real start
# time, it runs the drill and reports what the drill said (were it signalled, it would die -9)
ANCESTOR = """
import json, os, subprocess, sys, time
from trainguard.core.agentmark import hold_mark
from trainguard.core.events import node_name
from trainguard.core.proctime import process_start_time
run_dir = sys.argv[1]
assert hold_mark(run_dir) is not None
with open(os.path.join(run_dir, "events.jsonl"), "a") as f:
    for ev in ({"kind": "launch", "pid": os.getpid(), "process_start": process_start_time()},
               {"kind": "rendezvous", "members": [{"node": node_name(), "pid": os.getpid()}]}):
        f.write(json.dumps({"time": time.time(), "node": node_name(), **ev}) + "\\n")
r = subprocess.run([sys.executable, "-m", "trainguard", "chaos", "kill-agent", run_dir,
                    "--group-rank", "0"], capture_output=True, text=True, timeout=120)
print(json.dumps({"rc": r.returncode, "err": r.stderr}))
"""


def _drill(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str
) -> subprocess.CompletedProcess[str]:
    """``trainguard chaos`` in this process, for refusals only (its command line is tested
    above): a signal it would send is recorded and fails the test instead of reaching init or
    the bystanders (a drill that took pid 1 would kill every process of the machine)."""
    from trainguard.cli import cmd_chaos

    sent: list[tuple[int, int]] = []
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
        rc = cmd_chaos.main(list(args))
    out = capsys.readouterr()
    assert not sent, f"{args} signalled {sent}: {out}"
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


def test_forged_launch_naming_init_a_bystander_or_the_callers_parent_is_refused(
    tmp_path: Path,
    procs: list[subprocess.Popen[bytes]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent, worker = _agent_with_worker(procs, tmp_path / "run")  # a real mark in the run dir
    bystander = _start(procs, "sleep", "600").pid
    forged = [1, bystander]
    if os.geteuid() == 0:  # a process of another user that holds the mark (given to it)
        fd = os.open(tmp_path / "run" / "agent.mark", os.O_RDONLY)
        other = subprocess.Popen(["sleep", "600"], user="nobody", pass_fds=[fd],
                                 start_new_session=True)  # fmt: skip
        os.close(fd)
        procs.append(other)
        forged.append(other.pid)
    members = [{"node": node_name(), "pid": p} for p in forged]
    run_dir = _run_dir(
        tmp_path,
        # each with its real start time, as anyone can read it from /proc/<pid>/stat
        *({"kind": "launch", "pid": p, "process_start": process_start_time(p)} for p in forged),
        {"kind": "rendezvous", "members": members},
        {"kind": "workers_started", "workers": [{"rank": 0, "pid": 1}]},
        # the worker of this node's agent, recorded by another node: not that node's agent's
        {"kind": "workers_started", "node": "elsewhere", "workers": [{"rank": 1, "pid": worker}]},
    )
    whys = [
        "is init (pid 1), never a process of a job",
        "does not hold the run directory's agent.mark open (not an agent of it)",
        "is not run by the run directory's owner (uid 0)",
    ]
    for i, why in enumerate(whys[: len(forged)]):
        r = _drill(capsys, monkeypatch, "kill-agent", str(run_dir), "--group-rank", str(i))
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.strip() == (
            f"trainguard chaos: error: pid {forged[i]}, recorded for group rank {i}, {why}: "
            "not signalled"
        ), r.stderr
    r = _drill(
        capsys, monkeypatch, "kill-agent", str(run_dir), "--pid", "1"
    )  # named on the command line too
    assert r.returncode == 2 and "is init (pid 1)" in r.stderr, r.stderr
    r = _drill(capsys, monkeypatch, "kill-agent", "--pid", "1")
    assert r.returncode == 2 and "is init (pid 1)" in r.stderr, r.stderr
    r = _drill(capsys, monkeypatch, "pause", "--pid", "1", "--seconds", "1")
    assert r.returncode == 2 and "is init (pid 1)" in r.stderr, r.stderr
    r = _drill(capsys, monkeypatch, "kill-rank", str(run_dir), "--rank", "0")
    assert r.returncode == 2 and "pid 1, recorded for rank 0, is init" in r.stderr, r.stderr
    r = _drill(capsys, monkeypatch, "kill-rank", str(run_dir), "--rank", "1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "is not in the process tree of an agent of this job" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # the drill's own parent, holding the mark, with a launch line of its real start
    wrapper = subprocess.run([sys.executable, "-c", ANCESTOR, str(run_dir)], env=base_env(),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert wrapper.returncode == 0, wrapper.stdout + wrapper.stderr
    said = json.loads(wrapper.stdout)
    assert (
        said["rc"] == 2
        and "is this command or one of its ancestors: not signalled" in (said["err"])
    ), said
    time.sleep(0.3)
    assert all(alive(p) for p in (agent, worker, *forged[1:]))


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


def test_pause_endpoint_honours_the_host(procs: list[subprocess.Popen[bytes]]) -> None:
    port = free_port()
    server = _start(procs, sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.2")
    from trainguard.chaos.ops import listening_pids

    deadline = time.monotonic() + 60
    while server.pid not in listening_pids(port):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # another address of this machine on the same port: that is not the service
    r = _chaos("pause", "--endpoint", f"127.0.0.1:{port}", "--seconds", "0.5")
    assert r.returncode == 2 and f"listens on 127.0.0.1:{port}" in r.stderr, r.stdout + r.stderr
    # an address of another machine: nothing here is signalled
    r = _chaos("pause", "--endpoint", f"192.0.2.1:{port}", "--seconds", "0.5")
    assert r.returncode == 2 and "not an address of this machine" in r.stderr, r.stderr
    assert _state(server.pid) != "T"
    r = _chaos("pause", "--endpoint", f"127.0.0.2:{port}", "--seconds", "0.5")
    assert r.returncode == 0 and f"stopped [{server.pid}]" in r.stdout, r.stderr
    assert os.path.exists(f"/proc/{server.pid}") and _state(server.pid) != "T"
