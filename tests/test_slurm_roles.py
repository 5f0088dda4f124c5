"""Roles on nodes of their own under ``trainguard sbatch``, on a real Slurm 22.05 (2 nodes on
this machine): the trainer on one node, a rollout engine (tests/workers/role_replica.py, a
real HTTP server process) on the other; the engine killed -9 mid-run is restarted by its own
node's agent on its port while the trainer keeps its workers (restart count 0); the job
completes. A job that asks for more nodes than the partition has submits nothing."""

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

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

REPLICA = [sys.executable, str(WORKERS / "role_replica.py")]
TRAINER = str(WORKERS / "role_trainer.py")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    yield from start_cluster(2)


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


def test_more_role_nodes_than_the_partition_submits_nothing(
    cluster: SlurmCluster,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainguard.cli import cmd_sbatch

    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    before = cluster.jobs()
    capsys.readouterr()
    rc = cmd_sbatch.main(
        ["--nodes", "2", "--tg-role", "rollout=1,nodes=1,port=8100:python e.py", "t.py"]
    )
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert "--nodes 2 + --spares 0 + 1 role node(s) = 3 nodes, but partition" in lines[0]
    assert cluster.jobs() == before
