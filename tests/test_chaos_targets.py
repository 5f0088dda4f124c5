"""``trainguard chaos`` signals only what is verifiably the job's, on real processes: a pid
written into events.jsonl that is not a process of one of the job's agents (checked by the
agent's recorded start time and the process tree) is refused and stays alive; ``pause
--endpoint HOST:PORT`` acts only on a listener of that host."""

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
from tests.ports import free_port
from tests.procs import alive, descendants, kill_tree
from trainguard.core.events import node_name
from trainguard.core.proctime import process_start_time

CHAOS = [sys.executable, "-m", "trainguard", "chaos"]
SPAWNER = "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"


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


def _agent_with_worker(procs: list[subprocess.Popen[bytes]]) -> tuple[int, int]:
    """A process standing in for an agent and its child standing in for a worker."""
    agent = _start(procs, sys.executable, "-c", SPAWNER)
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
    agent, worker = _agent_with_worker(procs)
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
    agent, _ = _agent_with_worker(procs)
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
