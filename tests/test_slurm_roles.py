"""Roles on nodes of their own under ``trainguard sbatch``, on a real Slurm 22.05 (4 nodes on
this machine): the trainer on one node, a rollout engine (tests/workers/role_replica.py, a
real HTTP server process) on the other; the engine killed -9 mid-run is restarted by its own
node's agent on its port while the trainer keeps its workers (restart count 0); the job
completes. With 3 role nodes (1 spare): a role node's agent killed -9 mid-run takes only its
replica, which comes back on the spare while the node is drained with the cause and the
trainer never restarts (the job completes); two role nodes lost at once leave the role below
its floor: one line and exit code 96. A job that asks for more nodes than the partition has
submits nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.launch_utils import WORKERS, free_port
from tests.procs import alive
from tests.services.slurm_cluster import SlurmCluster, start_cluster
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import read_events
from trainguard.core.failures import ROLE_BELOW_FLOOR_EXIT_CODE

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

REPLICA = [sys.executable, str(WORKERS / "role_replica.py")]
TRAINER = str(WORKERS / "role_trainer.py")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    yield from start_cluster(4)


def _wait(what: str, cond: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def _records(out: Path) -> list[dict[str, Any]]:
    recs = []
    for f in sorted(out.glob("rank_*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
    return recs


def _serving(run_dir: Path) -> dict[str, Any] | None:
    states = RunDir(run_dir).role_states().get("rollout", [])
    return states[0] if states and states[0]["state"] == "serving" else None


def _config(d: Path, port: int) -> Path:
    f = d / "tg.toml"
    f.write_text(
        f"[slurm]\nrdzv_port = {free_port()}\njoin_timeout_s = 120\n\n"
        "[roles]\nprobe_interval_s = 0.25\nprobe_timeout_s = 1.0\nstop_timeout_s = 3.0\n\n"
        f"[roles.rollout]\ncommand = {json.dumps(REPLICA)}\nreplicas = 1\nnodes = 1\n"
        f"port = {port}\nrestart_budget = 2\n"
    )
    return f


def test_engine_on_its_own_node_restarts_alone(cluster: SlurmCluster, tmp_path: Path) -> None:
    c = cluster
    c.restore_nodes()
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    env = dict(c.env, OUT_DIR=str(out), TRAINGUARD_HEALTH_ENABLED="0")
    p = subprocess.run(
        [sys.executable, "-m", "trainguard", "sbatch", "--nodes", "1",
         "--config", str(_config(tmp_path, port)), "--nproc-per-node", "1", "--no-tg-warm",
         "--monitor-interval", "0.1", TRAINER],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    run_dir = tmp_path / "trainguard-runs" / f"slurm-{job}"
    engine = None
    try:
        c.wait_job(job, {"RUNNING", "COMPLETED", "FAILED", "CANCELLED"}, 120)  # nodes known
        hosts = c.run("scontrol", "show", "hostnames", c.job_field(job, "NodeList")).split()
        assert len(hosts) == 2  # one trainer node + the role's own
        trainer_node, role_node = hosts
        first = _wait("the engine serving", lambda: _serving(run_dir), 120)
        engine = first["pid"]
        # it runs on the role's node, binds that node's Slurm address (NodeAddr 127.0.0.1
        # here) and the trainer's workers got that URL
        assert first["node"] == role_node and first["url"] == f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(first["url"] + "/whoami", timeout=5) as r:
            who = json.loads(r.read())
        assert (who["slurm_node"], who["host"]) == (role_node, "127.0.0.1")
        _wait("the trainer reaches the engine", lambda: any(
            r["engines"] == [engine] for r in _records(out)), 120)  # fmt: skip

        os.kill(engine, signal.SIGKILL)
        second = _wait(
            "the engine restarted",
            lambda: (s := _serving(run_dir)) and s["pid"] != engine and s,
            60,
        )
        engine = second["pid"]
        assert second["port"] == port and second["node"] == role_node
        _wait("the trainer reaches the new engine", lambda: any(
            r["engines"] == [engine] for r in _records(out)), 60)  # fmt: skip
        (out / "stop").touch()
        state = c.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, 120)
        log = tmp_path / "trainguard-runs" / f"slurm-{job}.out"
        assert state == "COMPLETED", log.read_text() if log.exists() else ""
    finally:
        jobs = c.jobs()
        if jobs:
            c.run("scancel", *jobs, check=False)
        c.kill_job_processes()
    # the trainer never restarted: one worker, restart count 0, no restart event
    recs = _records(out)
    assert {r["restart"] for r in recs} == {0} and len({r["pid"] for r in recs}) == 1
    ev = list(read_events(run_dir))
    assert [e for e in ev if e["kind"] in ("restart", "worker_failed")] == []
    (finished,) = [e for e in ev if e["kind"] == "job_finished"]
    assert (finished["node"], finished["state"], finished["restarts"]) == (
        trainer_node,
        "succeeded",
        0,
    )
    # the role's restart, in its own events, on its own node
    (failed,) = [e for e in ev if e["kind"] == "role_replica_failed"]
    assert failed["node"] == role_node and failed["pid"] == first["pid"]
    started = [e for e in ev if e["kind"] == "role_replica_started"]
    assert [(e["node"], e["role_restarts"]) for e in started] == [(role_node, 0), (role_node, 1)]
    assert RunDir(run_dir).role_states()["rollout"][0]["state"] == "stopped"
    assert not alive(engine)  # stopped by its agent when the trainer was done
    (fin,) = [e for e in ev if e["kind"] == "slurm_finish"]
    assert fin["action"] == "done" and not (run_dir / f"roles-{job}.failed").exists()
    assert [e for e in ev if e["kind"] == "node_drained"] == []  # the role node is not "lost"
    assert "DRAIN" not in c.node_state(role_node)[0]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--nodes", "2", "--tg-role", "rollout=2,nodes=2,spares=1,port=8100:python e.py"],
            "--nodes 2 + --spares 0 + 2 role node(s) + 1 role spare(s) = 5 nodes, but "
            "partition",
        ),
        (
            ["--nodes", "1", "--tg-role", "rollout=2,nodes=2,floor=3,port=8100:python e.py"],
            "role 'rollout': floor 3 > replicas 2",
        ),
        (
            ["--nodes", "1", "--tg-role", "rollout=2,spares=1,port=8100:python e.py"],
            "role 'rollout': spares 1 without nodes",
        ),
        (["--nodes", "1", "--config", "router.toml"], "[roles] router_port {port} on 127.0.0.1:"),
    ],
    ids=["role-spares-past-the-partition", "floor-above-replicas", "spares-without-nodes",
         "router-port-taken"],
)  # fmt: skip
def test_bad_role_input_submits_nothing(
    cluster: SlurmCluster,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    says: str,
) -> None:
    import socket

    from trainguard.cli import cmd_sbatch

    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    with socket.socket() as held:  # the fleet endpoint's fixed port, taken
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        (tmp_path / "router.toml").write_text(
            f"[roles]\nrouter = true\nrouter_port = {port}\n\n[roles.rollout]\n"
            "command = 'python e.py'\nreplicas = 1\nnodes = 1\nport = 8100\n"
        )
        before = cluster.jobs()
        capsys.readouterr()
        rc = cmd_sbatch.main([*argv, "t.py"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert says.format(port=port) in lines[0], lines[0]
    assert cluster.jobs() == before
    assert not (tmp_path / "trainguard-runs").exists()  # nothing started


def _role_agent(c: SlurmCluster, node: str) -> int:
    """The PID of the ``trainguard slurm roles`` agent Slurm runs on ``node``."""
    conf, name = f"SLURM_CONF={c.conf}".encode(), f"SLURMD_NODENAME={node}".encode()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
            env = (p / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"slurm" in argv and b"roles" in argv and conf in env and name in env:
            return int(p.name)
    raise AssertionError(f"no role agent on {node}")


def _spare_config(d: Path) -> Path:
    rdzv = free_port()
    # replicas 0 and 1 bind port and port + 1: both taken from the tests' shared counter (a
    # port + 1 only seen free here was handed to a parallel test, which then held it)
    port = free_port(count=2)
    f = d / "tg.toml"
    f.write_text(
        f"[slurm]\nrdzv_port = {rdzv}\njoin_timeout_s = 120\n\n"
        "[roles]\nprobe_interval_s = 0.25\nprobe_timeout_s = 1.0\nstop_timeout_s = 3.0\n"
        "node_dead_after_s = 3\n\n"
        f"[roles.rollout]\ncommand = {json.dumps(REPLICA)}\nreplicas = 2\nnodes = 2\n"
        f"spares = 1\nfloor = 2\nport = {port}\n"
    )
    return f


def _submit_spare_job(c: SlurmCluster, d: Path, out: Path) -> tuple[str, Path, list[str]]:
    out.mkdir()
    env = dict(c.env, OUT_DIR=str(out), TRAINGUARD_HEALTH_ENABLED="0")
    p = subprocess.run(
        [sys.executable, "-m", "trainguard", "sbatch", "--nodes", "1",
         "--config", str(_spare_config(d)), "--nproc-per-node", "1",
         "--no-tg-warm", "--monitor-interval", "0.1", TRAINER],
        cwd=d, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    c.wait_job(job, {"RUNNING", "COMPLETED", "FAILED", "CANCELLED"}, 120)
    hosts = c.run("scontrol", "show", "hostnames", c.job_field(job, "NodeList")).split()
    assert len(hosts) == 4  # the trainer's node + the role's 2 nodes + its spare
    return job, d / "trainguard-runs" / f"slurm-{job}", hosts


def _both_serving(run_dir: Path) -> list[dict[str, Any]] | None:
    states = RunDir(run_dir).role_states().get("rollout", [])
    return states if len(states) == 2 and all(s["state"] == "serving" for s in states) else None


def test_role_node_lost_replaced_on_the_spare_then_below_the_floor(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    c = cluster
    c.restore_nodes()
    out = tmp_path / "out"
    try:
        job, run_dir, hosts = _submit_spare_job(c, tmp_path, out)
        trainer_node, node_a, node_b, spare = hosts
        first = _wait("both engines serving", lambda: _both_serving(run_dir), 120)
        assert [s["node"] for s in first] == [node_a, node_b]
        _wait("the trainer reaches both engines", lambda: any(
            r["engines"] == [s["pid"] for s in first] for r in _records(out)), 60)  # fmt: skip

        os.kill(_role_agent(c, node_a), signal.SIGKILL)  # the role node's agent, kill -9
        moved = _wait(
            "replica 0 serving on the spare",
            lambda: (s := _serving(run_dir)) and s["node"] == spare and s,
            60,
        )
        assert moved["pid"] != first[0]["pid"] and moved["port"] == first[0]["port"]
        _wait("the trainer reaches the moved engine", lambda: any(
            r["engines"] == [moved["pid"], first[1]["pid"]] for r in _records(out)), 60)  # fmt: skip
        state, reason = c.node_state(node_a)
        assert "DRAIN" in state and reason.startswith("trainguard: role node agent lost"), reason
        (out / "stop").touch()
        assert c.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, 120) == "COMPLETED", _log(
            tmp_path, job
        )
    finally:
        c.run("scancel", *c.jobs(), check=False) if c.jobs() else None
        c.kill_job_processes()
    recs = _records(out)
    assert {r["restart"] for r in recs} == {0} and len({r["pid"] for r in recs}) == 1
    ev = list(read_events(run_dir))
    assert [e for e in ev if e["kind"] in ("restart", "worker_failed")] == []
    (lost,) = [e for e in ev if e["kind"] == "role_node_lost"]
    assert (lost["node_name"], lost["replicas"], lost["spare"], lost["drained"]) == (
        node_a, [0], spare, True,
    )  # fmt: skip
    assert (lost["node"], lost["left"], lost["floor"]) == (trainer_node, 2, 2)
    (replaced,) = [e for e in ev if e["kind"] == "role_node_replaced"]
    assert (replaced["node"], replaced["replaces"], replaced["replicas"]) == (spare, node_a, [0])
    assert not (run_dir / f"roles-{job}.failed").exists()

    # a second job: two role nodes lost at once, one spare: the role falls below its floor
    c.restore_nodes()
    out2 = tmp_path / "out2"
    d2 = tmp_path / "second"
    d2.mkdir()
    try:
        job, run_dir, hosts = _submit_spare_job(c, d2, out2)
        _, node_a, node_b, spare = hosts
        _wait("both engines serving", lambda: _both_serving(run_dir), 120)
        for n in (node_a, node_b):
            os.kill(_role_agent(c, n), signal.SIGKILL)
        assert c.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, 120) == "FAILED"
        assert c.job_field(job, "ExitCode") == f"{ROLE_BELOW_FLOOR_EXIT_CODE}:0"
    finally:
        c.run("scancel", *c.jobs(), check=False) if c.jobs() else None
        c.kill_job_processes()
    log = _log(d2, job)
    lines = [x for x in log.splitlines() if "below its floor" in x and "role rollout" in x]
    assert len(lines) == 1, log
    # killed together: whichever loss the trainer's agent sees first takes the spare, and the
    # other one names the role below its floor
    below = "role rollout below its floor of 2: 1 of 2 replicas left; lost node {}"
    assert [n for n in (node_a, node_b) if below.format(n) in lines[0]], lines[0]
    recs = _records(out2)
    assert {r["restart"] for r in recs} == {0}


def _log(d: Path, job: str) -> str:
    f = d / "trainguard-runs" / f"slurm-{job}.out"
    return f.read_text() if f.exists() else ""
