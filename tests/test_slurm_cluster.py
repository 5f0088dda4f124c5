"""trainguard sbatch on a real Slurm 22.05 (4 nodes on this machine, one module-wide cluster):
a node crash mid-job is taken over by the spare and the node drained, then (the same job) a
preemption notice saves, requeues and resumes, and the requeued allocation with a new spare
completes with the weights of a local run (the spare released, `trainguard slurm status`
says so); a lost node with no spare left resubmits the job without it; bad input submits
nothing. On the cluster's etcd (etcd-v3 rendezvous): the spare takes over a crashed node
through trainguard's liveness beacons, and a crash of the batch host resubmits the job without
it, which resumes from its newest checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.launch_utils import REPO, free_port
from tests.mlp_reference import assert_same_as_reference
from tests.services.slurm_cluster import SlurmCluster, start_cluster
from trainguard.telemetry.summary import recovery_summary

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

TRAIN = str(REPO / "examples" / "train_mlp.py")
STEPS = 60
TRAIN_ARGS = ["--steps", str(STEPS), "--ckpt-every", "10", "--step-sleep", "0.15"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    yield from start_cluster(4)


@pytest.fixture
def fresh(cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The cluster with every node idle before the test, and no job left after it."""
    cluster.restore_nodes()
    yield cluster
    jobs = cluster.jobs()
    if jobs:
        cluster.run("scancel", *jobs, check=False)
        deadline = time.monotonic() + 30
        while cluster.jobs() and time.monotonic() < deadline:
            time.sleep(0.5)
    cluster.kill_job_processes()


def _config(d: Path, **slurm: object) -> Path:
    lines = ["[slurm]", f"rdzv_port = {free_port()}"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in slurm.items()]
    f = d / "tg.toml"
    f.write_text("\n".join(lines) + "\n")
    return f


def _sbatch(c: SlurmCluster, d: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainguard", "sbatch", *args],
        cwd=d, env=c.env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _submit(c: SlurmCluster, d: Path, *args: str, steps_args: list[str] | None = None) -> str:
    p = _sbatch(c, d, *args, "--nproc-per-node", "1", TRAIN, *(steps_args or TRAIN_ARGS),
                "--out", str(d / "final.pt"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    assert job.isdigit(), p.stdout
    # c10d (no etcd named): one line says that the first node is a single point of failure
    on_etcd = "etcd_endpoint" in Path(args[args.index("--config") + 1]).read_text()
    notes = [x for x in p.stderr.splitlines() if "single point of failure" in x]
    assert len(notes) == (0 if on_etcd else 1), p.stderr
    return job


def _events(run_dir: Path) -> list[dict]:
    f = run_dir / "events.jsonl"
    if not f.exists():
        return []
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()]


def _wait_event(run_dir: Path, pred, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in _events(run_dir):
            if pred(ev):
                return ev
        time.sleep(0.5)
    tail = [
        {k: ev.get(k) for k in ("time", "kind", "node", "state", "reason", "attempt") if k in ev}
        for ev in _events(run_dir)[-25:]
    ]
    log = run_dir.parent / f"{run_dir.name}.out"
    raise TimeoutError(
        f"no {what} in {run_dir}/events.jsonl after {timeout:.0f} s; the last events: {tail}"
        + (f"\nthe job's output ends:\n{log.read_text()[-3000:]}" if log.exists() else "")
    )


def _log(c: SlurmCluster, d: Path, job: str) -> str:
    f = d / "trainguard-runs" / f"slurm-{job}.out"
    return f.read_text() if f.exists() else ""


def _steps_after(run_dir: Path, t: float) -> list[float]:
    out = []
    for f in (run_dir / "metrics").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("kind") == "step" and r["time"] > t:
                out.append(r["time"])
    return sorted(out)


def _first_node(c: SlurmCluster, job: str) -> str:
    return c.run("scontrol", "show", "hostnames", c.job_field(job, "NodeList")).split()[0]


def test_node_crash_spare_takes_over_then_preemption_saves_requeues_and_resumes(
    fresh: SlurmCluster, tmp_path: Path
) -> None:
    """One 2+1 job on c10d: a node crash mid-job is taken over by the spare and the node
    drained; then a preemption notice saves, requeues and resumes on a new allocation (without
    the drained node, with a new spare), which completes with a fault-free run's weights."""
    c = fresh
    steps = 80  # the preemption comes after the takeover: room for both before the end
    cfg = _config(tmp_path, join_timeout_s=120, max_resubmits=0)
    job = _submit(c, tmp_path, "--nodes", "2", "--spares", "1", "--config", str(cfg),
                  steps_args=["--steps", str(steps), *TRAIN_ARGS[2:]])  # fmt: skip
    run_dir = tmp_path / "trainguard-runs" / f"slurm-{job}"
    _wait_event(run_dir, lambda e: e["kind"] == "checkpoint_committed", 180, "checkpoint")
    rdzv = next(e for e in _events(run_dir) if e["kind"] == "rendezvous")
    active = [m["node"] for m in rdzv["members"]]
    first = _first_node(c, job)  # hosts the c10d store: the single point of failure
    victim = next(n for n in active if n != first)
    t0 = time.time()
    c.node("crash", victim)
    started = _wait_event(
        run_dir,
        lambda e: e["kind"] == "workers_started" and e["time"] > t0 and e["attempt"] >= 1,
        120,
        "workers started after the crash",
    )
    takeover_s = started["time"] - t0
    print(f"spare took over {takeover_s:.1f} s after the crash of {victim}")
    # drained by a surviving agent as the spare's round formed, not only at the job's end
    drain = _wait_event(run_dir, lambda e: e["kind"] == "node_drained", 60, "the drain")
    assert drain["node_name"] == victim and drain["fenced"]
    takeover_round = [e for e in _events(run_dir) if e["kind"] == "rendezvous"][-1]
    members = {m["node"] for m in takeover_round["members"]}
    assert victim not in members and len(members) == 2
    st, reason = c.node_state(victim)
    assert "DRAIN" in st and reason.startswith(f"trainguard: node left job {job} at attempt 1")

    # training goes on at full size; then the preemption notice: the batch shell and every
    # process of the step get it, as from --signal=USR1@grace
    _wait_event(
        run_dir,
        lambda e: e["kind"] == "checkpoint_committed" and e["time"] > started["time"],
        120,
        "a checkpoint after the takeover",
    )
    c.run("scancel", "--signal=USR1", "--full", job)
    saved = _wait_event(run_dir, lambda e: e["kind"] == "checkpoint_preempt_saved", 60, "save")
    assert saved["committed"] is True
    requeue = _wait_event(
        run_dir,
        lambda e: e["kind"] == "slurm_finish" and e["action"] == "requeue",
        60,
        "requeue",
    )
    assert drain["time"] < requeue["time"]
    restored = _wait_event(
        run_dir,
        lambda e: (
            e["kind"] == "checkpoint_restored"
            and e.get("step") is not None
            and e["time"] > requeue["time"]
        ),
        240,
        "restore after the requeue",
    )
    assert restored["step"] == saved["step"] and restored["source"] == "disk"
    assert c.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, 240) == "COMPLETED", _log(
        c, tmp_path, job
    )
    assert c.job_field(job, "Restarts") == "1"
    assert_same_as_reference(tmp_path / "final.pt", steps)  # a fault-free run's weights
    ev = _events(run_dir)
    assert [e["node_name"] for e in ev if e["kind"] == "node_drained"] == [victim]  # once
    # the scheduler's share, per allocation, from the batch host's agent: this cluster keeps
    # no accounting (no slurmdbd), so sacct fails (a counted warning) and scontrol answers
    sched = [e for e in ev if e["kind"] == "slurm_schedule"]
    assert [(e["job_id"], e["restart"]) for e in sched] == [(job, 0), (job, 1)], sched
    for e in sched:
        assert e["source"] == "scontrol" and e["warnings"][0].startswith("sacct: "), e
        assert e["queue_wait_s"] >= 0 and e["prolog_s"] >= 0 and e["start"] >= e["submit"]
    assert "requeue_gap_s" not in sched[0]
    # the requeued run may start only after cred_expire (10 s here) + 1 s
    assert sched[1]["requeue_gap_s"] >= 5, sched[1]
    lines = recovery_summary(run_dir)
    assert "requeue_wait" in lines[0], lines[0]  # in the goodput breakdown
    assert any(x.startswith(f"  Slurm job {job} restart 1: ") for x in lines), lines
    # the requeued allocation ran fault-free with its spare: every node ended, named by Slurm
    # (all nodes here share one hostname); the drained node was not allocated again
    allocation = c.run("scontrol", "show", "hostnames", c.job_field(job, "NodeList")).split()
    assert victim not in allocation
    finished = {
        e["node"]: e["state"]
        for e in ev
        if e["kind"] == "job_finished" and e["time"] > restored["time"]
    }
    assert sorted(finished) == allocation
    states = sorted(finished.values())
    # the spare ends without training: it saw the rendezvous close, or (when the store's host
    # exited first) lost the store; either way exit 0 and one line
    assert states[1:] == ["succeeded", "succeeded"]
    assert states[0] in ("spare_released", "rendezvous_lost")
    p = subprocess.run(
        [sys.executable, "-m", "trainguard", "slurm", "status", job, "--json"],
        cwd=tmp_path, env=c.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    status = json.loads(p.stdout)
    assert status["state"] == "COMPLETED" and len(status["active"]) == 2
    assert len(status["spares"]) == 1 and list(status["drained"]) == [victim]
    assert status["last_checkpoint_step"] == steps


def test_spares_exhausted_resubmits_without_the_bad_node(
    fresh: SlurmCluster, tmp_path: Path
) -> None:
    c = fresh
    cfg = _config(tmp_path, join_timeout_s=20, max_resubmits=1)
    job = _submit(c, tmp_path, "--nodes", "2", "--spares", "0", "--config", str(cfg))
    run_dir = tmp_path / "trainguard-runs" / f"slurm-{job}"
    _wait_event(run_dir, lambda e: e["kind"] == "checkpoint_committed", 180, "checkpoint")
    first = _first_node(c, job)
    nodes = c.run("scontrol", "show", "hostnames", c.job_field(job, "NodeList")).split()
    victim = next(n for n in nodes if n != first)
    c.node("crash", victim)
    resub = _wait_event(run_dir, lambda e: e["kind"] == "resubmit", 300, "resubmission")
    assert resub["exclude"] == [victim]
    job2 = resub["new_job_id"]
    assert c.wait_job(job, {"FAILED", "COMPLETED", "CANCELLED"}, 60) == "FAILED"
    assert c.wait_job(job2, {"COMPLETED", "FAILED", "CANCELLED"}, 300) == "COMPLETED", _log(
        c, tmp_path, job2
    )
    assert c.job_field(job2, "ExcNodeList") == victim
    assert victim not in c.run("scontrol", "show", "hostnames", c.job_field(job2, "NodeList"))
    st, reason = c.node_state(victim)
    assert "DRAIN" in st and reason.startswith("trainguard: ")
    # the resubmitted job trained on in the same run directory, from the checkpoint
    restored = [e for e in _events(run_dir) if e["kind"] == "checkpoint_restored"]
    assert restored[-1]["source"] == "disk" and restored[-1]["step"] >= 10
    assert_same_as_reference(tmp_path / "final.pt", STEPS)  # a fault-free run's weights


@pytest.mark.etcd
@pytest.mark.xdist_group("slurm")  # the Slurm group's cluster; etcd: the session's
def test_etcd_job_spare_takes_over_by_liveness_beacons(
    fresh: SlurmCluster, tmp_path: Path, etcd: Any
) -> None:
    c = fresh
    cfg = _config(tmp_path, join_timeout_s=120, max_resubmits=0, etcd_endpoint=etcd.endpoint)
    p = _sbatch(c, tmp_path, "--nodes", "2", "--spares", "1", "--config", str(cfg),
                "--nproc-per-node", "1", TRAIN, *TRAIN_ARGS, "--out", str(tmp_path / "final.pt"))  # fmt: skip
    assert p.returncode == 0 and "single point of failure" not in p.stderr, p.stderr
    job = p.stdout.strip()
    run_dir = tmp_path / "trainguard-runs" / f"slurm-{job}"
    _wait_event(run_dir, lambda e: e["kind"] == "checkpoint_committed", 180, "checkpoint")
    rdzv = next(e for e in _events(run_dir) if e["kind"] == "rendezvous")
    assert "--rdzv-backend etcd-v3" in (run_dir / "job.sbatch").read_text()
    batch_host = c.job_field(job, "BatchHost")
    victim = next(m for m in rdzv["members"] if m["node"] != batch_host)
    t0 = time.time()
    c.node("crash", victim["node"])
    started = _wait_event(
        run_dir,
        lambda e: e["kind"] == "workers_started" and e["time"] > t0 and e["attempt"] >= 1,
        120,
        "workers started after the crash",
    )
    deadline = time.monotonic() + 60
    while not _steps_after(run_dir, started["time"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    step = _steps_after(run_dir, started["time"])[0]
    print(f"etcd-v3: crash of {victim['node']} -> next step {step - t0:.1f} s (workers started "
          f"{started['time'] - t0:.1f} s), load {os.getloadavg()[0]:.1f}")  # fmt: skip
    # out of the rendezvous by a beacon's silence, or with the round the surviving node ended
    # for every node when it left it first; not by torch's keep-alive expiry
    dead = [e for e in _events(run_dir) if e["kind"] == "node_dead"]
    ended = [e for e in _events(run_dir) if e["kind"] == "rdzv_round_ended"]
    assert dead or ended, "the lost node never left the rendezvous"
    for e in dead:
        assert f"_{victim['pid']}_" in e["dead_node"] and e["reason"] == "liveness_silent"
    assert any(e["kind"] == "spare_joined" for e in _events(run_dir))
    assert c.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, 300) == "COMPLETED", _log(
        c, tmp_path, job
    )
    last_round = [e for e in _events(run_dir) if e["kind"] == "rendezvous"][-1]
    assert victim["node"] not in {m["node"] for m in last_round["members"]}
    assert not any(e["kind"] == "resubmit" for e in _events(run_dir))
    assert_same_as_reference(tmp_path / "final.pt", STEPS)  # a fault-free run's weights


@pytest.mark.soak  # 3-5 min on 2 cores: two jobs, a crash and a resubmission (make test-soak)
@pytest.mark.etcd
@pytest.mark.xdist_group("slurm")
def test_batch_host_crash_resubmits_without_it_and_resumes(
    fresh: SlurmCluster, tmp_path: Path, etcd: Any
) -> None:
    c = fresh
    cfg = _config(tmp_path, join_timeout_s=120, max_resubmits=1, etcd_endpoint=etcd.endpoint)
    job = _submit(c, tmp_path, "--nodes", "2", "--spares", "1", "--config", str(cfg))
    run_dir = tmp_path / "trainguard-runs" / f"slurm-{job}"
    _wait_event(run_dir, lambda e: e["kind"] == "checkpoint_committed", 180, "checkpoint")
    batch_host = c.job_field(job, "BatchHost")
    t0 = time.time()
    c.node("crash", batch_host)
    resub = _wait_event(run_dir, lambda e: e["kind"] == "resubmit", 120, "resubmission")
    assert resub["exclude"] == [batch_host] and resub["job_id"] == job
    job2 = resub["new_job_id"]
    # Slurm would have kept the job RUNNING without its batch script: the taking-over agent
    # cancelled it
    assert c.wait_job(job, {"CANCELLED", "COMPLETED", "FAILED"}, 120) == "CANCELLED"
    restored = _wait_event(
        run_dir,
        lambda e: e["kind"] == "checkpoint_restored" and e["time"] > resub["time"],
        240,
        "restore in the resubmitted job",
    )
    deadline = time.monotonic() + 60
    while not _steps_after(run_dir, restored["time"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    step = _steps_after(run_dir, restored["time"])[0]
    print(f"batch host {batch_host} crashed: resubmitted after {resub['time'] - t0:.1f} s, "
          f"next step {step - t0:.1f} s, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    assert c.wait_job(job2, {"COMPLETED", "FAILED", "CANCELLED"}, 300) == "COMPLETED", _log(
        c, tmp_path, job2
    )
    assert c.job_field(job2, "ExcNodeList") == batch_host
    assert batch_host not in c.run("scontrol", "show", "hostnames", c.job_field(job2, "NodeList"))
    st, reason = c.node_state(batch_host)
    assert "DOWN" in st and reason.startswith("trainguard: ")  # set down by the taking-over agent
    # from the newest checkpoint committed before the new job restored
    ev = _events(run_dir)
    committed = [e["step"] for e in ev if e["kind"] == "checkpoint_committed"
                 and e["time"] < restored["time"]]  # fmt: skip
    assert restored["source"] == "disk" and restored["step"] == max(committed)
    assert_same_as_reference(tmp_path / "final.pt", STEPS)  # a fault-free run's weights


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--nodes", "2", "--partition", "gpu", TRAIN], "unknown partition 'gpu'"),
        (["--nodes", "3", "--spares", "2", TRAIN], "= 5 nodes, but partition debug has 4"),
        (["--nodes", "2", "--time", "1:2:3:4", TRAIN], "not a Slurm time limit"),
        (["--nodes", "2", "--sbatch-arg", "--mem=999999999", TRAIN],
         "Slurm would not run this job"),
        (["--nodes", "2", "nope.py"], "training script 'nope.py' not found"),
    ],
)  # fmt: skip
def test_bad_input_submits_nothing(
    cluster: SlurmCluster,
    tmp_path: Path,
    args: list[str],
    fragment: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainguard.cli import cmd_sbatch

    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    monkeypatch.chdir(tmp_path)
    before = cluster.jobs()
    capsys.readouterr()
    # in this process (no interpreter start for one line); that `python -m trainguard` exits
    # with a subcommand's 2 is checked by `trainguard health --slurm` in
    # test_fencer_and_health_drain_on_the_real_cluster
    rc = cmd_sbatch.main(args)
    out = capsys.readouterr()
    assert rc == 2
    lines = [x for x in out.err.splitlines() if x.strip()]
    assert len(lines) == 1 and fragment in lines[0], out.err
    assert out.out == "" and cluster.jobs() == before
    assert not (tmp_path / "trainguard-runs").exists()


def test_fencer_and_health_drain_on_the_real_cluster(fresh: SlurmCluster, tmp_path: Path) -> None:
    from trainguard.slurm.cli import CommandSlurm
    from trainguard.slurm.fencer import SlurmFencer

    c = fresh
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(c.conf)
    try:
        res = SlurmFencer(CommandSlurm(), record_only=True).fence("node4", "just looking")
        assert not res.fenced and c.node_state("node4")[0] == "IDLE"
        res = SlurmFencer(CommandSlurm()).fence("node4", "XID 79 on GPU 2")
        assert res.fenced
        st, reason = c.node_state("node4")
        assert st == "IDLE+DRAIN" and reason.startswith("trainguard: XID 79 on GPU 2 [")
    finally:
        if old is None:
            del os.environ["SLURM_CONF"]
        else:
            os.environ["SLURM_CONF"] = old
    # trainguard health --slurm as a node's check: a failing node drains itself
    toml = tmp_path / "h.toml"
    toml.write_text(
        '[health]\nmin_free_memory_gib = 1000000\ncounter_policy = {host_memory_low = "drain"}\n'
    )
    env = dict(c.env, SLURMD_NODENAME="node3")
    p = subprocess.run(
        [sys.executable, "-m", "trainguard", "health", "--slurm", "--config", str(toml)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    st, reason = c.node_state("node3")
    assert "DRAIN" in st and reason.startswith("trainguard: health: host: ")
    assert "drained node node3" in p.stderr
    # a healthy node is left alone
    p = subprocess.run(
        [sys.executable, "-m", "trainguard", "health", "--slurm"],
        cwd=tmp_path, env=dict(c.env, SLURMD_NODENAME="node2"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode in (0, 1) and c.node_state("node2")[0] == "IDLE"
