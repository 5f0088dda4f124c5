"""The recovery policy in real multi-agent jobs: several `trainguard run` agents on one machine,
c10d rendezvous on loopback, gloo workers.

- budget: a job whose rank crashes on every attempt stops after the job-wide budget, every
  agent exits 93; a crash loop without checkpoint progress stops before the budget, also 93;
- eviction: 2 active agents + 1 spare; one node's dcgm-exporter turns to XID 79 mid-run: that
  node is evicted (exit 94, one line), the spare joins, the job finishes; the node started
  again while blocklisted is refused (exit 94, until when); after the cooldown it is admitted.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from tests.health_fixtures.jobs import events, wait_for_event
from tests.launch_utils import base_env, free_port, wait_listening
from tests.procs import kill_tree
from trainguard.core.failures import DO_NOT_REQUEUE_EXIT_CODE, EVICTED_EXIT_CODE
from trainguard.testing.dcgm import ExporterServer, h100_node

WORKER = Path(__file__).resolve().parent / "workers" / "recovery_worker.py"
GATED = Path(__file__).resolve().parent / "workers" / "gated_run.py"


class Agent:
    """One node's `trainguard run` (its own session; stderr collected by a thread)."""

    def __init__(self, node: str, cmd: list[str], *, cwd: Path, env: dict[str, str]) -> None:
        self.node = node
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env={**env, "SLURMD_NODENAME": node},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float = 120) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"node {self.node}'s agent did not end in {timeout} s; its stderr ends:\n"
                + self.stderr[-3000:]
            ) from None
        self._reader.join(10)
        return rc

    def kill(self) -> None:
        kill_tree(self.proc)


def spares(store: TCPStore, run_id: str) -> set[int]:
    """Pids of the agents waiting in the rendezvous's redundancy list (torch's own state in the
    c10d store, which torch pickles)."""
    got = C10dRendezvousBackend(store, run_id).get_state()
    return {n.pid for n in pickle.loads(got[0]).redundancy_list} if got else set()


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise TimeoutError(what)


def node_cmd(run_dir: Path, port: int, worker_args: list[str], *, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "trainguard", "run", "--nnodes", "2", "--nproc-per-node", "1",
        "--max-restarts", "10", "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "tg", *extra,
        "--tg-run-dir", str(run_dir), str(WORKER), *worker_args,
    ]  # fmt: skip


def job_env(**settings: str) -> dict[str, str]:
    env = base_env(
        TRAINGUARD_TELEMETRY_ENABLED="false",
        TRAINGUARD_CHECKPOINT_MEMORY_TIER="false",
        TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0",
        TRAINGUARD_HEALTH_MIN_FREE_DISK_GIB="0",
        TRAINGUARD_HEALTH_MIN_FREE_MEMORY_GIB="0",
        TRAINGUARD_RECOVERY_BACKOFF_BASE_S="0.5",
    )
    env.update(settings)
    return env


def start_two_nodes(
    tmp_path: Path, name: str, worker_args: list[str], *, env: dict[str, str], extra: list[str]
) -> tuple[Path, list[Agent]]:
    run_dir = tmp_path / name
    port = free_port()
    agents: list[Agent] = []
    for node in ("n0", "n1"):
        agents.append(
            Agent(node, node_cmd(run_dir, port, worker_args, extra=extra), cwd=tmp_path, env=env)
        )
        if node == "n0":
            wait_listening(port)  # n0 hosts the c10d store
    return run_dir, agents


def check_stopped(agents: list[Agent], reason: str) -> None:
    """Every agent exited 93 with one line that says why."""
    codes = [a.wait(timeout=200) for a in agents]
    assert codes == [DO_NOT_REQUEUE_EXIT_CODE] * 2, (
        agents[0].stderr[-3000:] + agents[1].stderr[-3000:]
    )
    for a in agents:
        last = a.stderr.strip().splitlines()[-1]
        assert reason in last and "exit 93: do not requeue" in last, a.stderr[-2000:]
        assert "Traceback" not in a.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_job_restart_budget_and_crash_loop_stop_every_agent_with_93(tmp_path: Path) -> None:
    """Two 2-node jobs side by side (they share nothing but the machine)."""
    # 1. Rank 0 crashes at step 2 on every attempt: budget 1 → restart 1, then stop (one
    # restart shows the job-wide count; the backoff's growth from the second restart on and a
    # budget of 2 are test_recovery_policy's, two agents' policies on one real TCPStore).
    budget_dir, budget = start_two_nodes(
        tmp_path, "budget", ["--steps", "50", "--crash-rank", "0", "--crash-at-step", "2"],
        env=job_env(TRAINGUARD_HEALTH_ENABLED="false"), extra=["--tg-restart-budget", "1"],
    )  # fmt: skip
    # 2. A crash loop: checkpoints at steps 2 and 4, then rank 1 crashes at step 5 on every
    # attempt; the restored job never gets past step 4: stop after 1 restart without progress,
    # long before the budget of 10.
    loop_dir, loop = start_two_nodes(
        tmp_path, "loop",
        ["--steps", "50", "--crash-rank", "1", "--crash-at-step", "5", "--ckpt-every", "2"],
        env=job_env(TRAINGUARD_HEALTH_ENABLED="false", TRAINGUARD_RECOVERY_CRASH_LOOP_RESTARTS="1"),
        extra=["--tg-restart-budget", "10"],
    )  # fmt: skip
    try:
        check_stopped(budget, "job restart budget spent: 1 of 1 job-wide restarts made")
        check_stopped(loop, "crash loop: 1 restarts without checkpoint progress")
    finally:
        for a in budget + loop:
            a.kill()

    decisions = events(budget_dir, "recovery_decision")
    # one decision per failed round, taken once (by the first agent to claim it), the same on
    # every agent that saw the round fail; the last one stops the job
    by_attempt: dict[int, set] = {}
    for d in decisions:
        if not d.get("learned"):
            by_attempt.setdefault(d["failed_attempt"], set()).add(
                (d["action"], d["job_restarts"], d["backoff_s"], d["decided_by"], d["budget"])
            )
    assert sorted(by_attempt) == [0, 1] and all(len(v) == 1 for v in by_attempt.values())
    summary = [next(iter(by_attempt[a]))[:3] for a in (0, 1)]
    assert summary == [("restart", 1, 0.0), ("stop", 1, 0.0)]
    assert all(next(iter(v))[4] == 1 for v in by_attempt.values())
    # every agent ends on the stop, the ones whose workers did not fail learn it from the store
    assert {d["node"] for d in decisions if d["action"] == "stop"} == {"n0", "n1"}
    assert {(e["node"], e["state"]) for e in events(budget_dir, "job_finished")} == {
        ("n0", "do_not_requeue"),
        ("n1", "do_not_requeue"),
    }
    # --max-restarts keeps torch's per-agent meaning: only failure restarts count against it
    # (one job-wide restart: at most one of each agent's 10 spent)
    restarts = events(budget_dir, "restart")
    assert len([r for r in restarts if r["reason"] == "failure"]) >= 1
    assert all(r["remaining_restarts"] >= 9 for r in restarts)

    [stop] = [d for d in events(loop_dir, "recovery_decision") if d["action"] == "stop"][:1]
    assert "newest committed step 4" in stop["reason"] and stop["job_restarts"] == 1
    assert max(e["step"] for e in events(loop_dir, "checkpoint_committed")) == 4
    assert {e["state"] for e in events(loop_dir, "job_finished")} == {"do_not_requeue"}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_health_eviction_spare_takes_over_blocklist_then_cooldown(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    until = tmp_path / "finish"
    port = free_port()
    cooldown_s = 10.0
    args = ["--steps", "100000", "--step-s", "0.05", "--until-file", str(until)]
    agents: list[Agent] = []
    servers = {n: ExporterServer(h100_node(hostname=n)) for n in ("na", "nb", "nc")}

    def start(node: str, gate: Path | None = None) -> Agent:
        env = job_env(
            TRAINGUARD_HEALTH_DCGM_URL=servers[node].url,
            TRAINGUARD_HEALTH_PROBE_INTERVAL_S="0.3",
            TRAINGUARD_HEALTH_SOURCES="dcgm_exporter,host",
            TRAINGUARD_RECOVERY_EVICTION_COOLDOWN_S=str(cooldown_s),
        )
        cmd = node_cmd(run_dir, port, args, extra=[])
        if gate is not None:  # "python -m trainguard" → gated_run.py GATE
            cmd = [sys.executable, str(GATED), str(gate), *cmd[3:]]
        agent = Agent(node, cmd, cwd=tmp_path, env=env)
        agents.append(agent)
        return agent

    for s in servers.values():
        s.__enter__()
    try:
        a = start("na")
        wait_listening(port)  # na hosts the c10d store: it must outlive the test's faults
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        b = start("nb")
        wait_for_event(run_dir, "workers_started", count=2, timeout=90)
        c = start("nc")
        # nb's next two starts, warm (imports done), each waiting for its gate
        gate2, gate3 = tmp_path / "start_b2", tmp_path / "start_b3"
        b2, b3 = start("nb", gate2), start("nb", gate3)
        wait_until(lambda: c.proc.pid in spares(store, "tg"), "nc never waited as a spare")

        servers["nb"].text = h100_node(hostname="nb", faults={3: {"DCGM_FI_DEV_XID_ERRORS": 79}})
        assert b.wait(timeout=60) == EVICTED_EXIT_CODE, b.stderr[-3000:]
        # nb started again at once, while blocklisted (its exporter is healthy again)
        servers["nb"].text = h100_node(hostname="nb")
        gate2.touch()
        last = b.stderr.strip().splitlines()[-1]
        assert "node nb evicted from job tg" in last and "XID 79" in last, b.stderr[-2000:]
        assert "blocklisted until" in last and "Traceback" not in b.stderr
        [evicted] = events(run_dir, "node_evicted")
        assert evicted["node"] == "nb" and evicted["fencer"] == "record"
        assert evicted["fenced"] is False and "XID 79" in evicted["reason"]
        assert evicted["until"] - evicted["time"] == pytest.approx(cooldown_s, abs=1)

        # the spare joins: a round with na and nc, workers running on nc
        wait_for_event(run_dir, "workers_started", count=4, timeout=90)
        assert {e["node"] for e in events(run_dir, "workers_started")[2:]} == {"na", "nc"}

        # the restarted nb is refused, one line saying until when
        assert b2.wait(timeout=90) == EVICTED_EXIT_CODE, b2.stderr[-3000:]
        last = b2.stderr.strip().splitlines()[-1]
        assert "node nb is blocklisted in job tg until" in last and "not joining" in last
        [refused] = events(run_dir, "node_refused")
        assert refused["node"] == "nb" and refused["until"] == evicted["until"]
        assert refused["time"] < evicted["until"]

        # after the cooldown: admitted (it waits as the new spare)
        while time.time() < evicted["until"] + 0.5:
            time.sleep(0.2)
        gate3.touch()
        wait_until(lambda: b3.proc.pid in spares(store, "tg"), "nb was not admitted as a spare")
        [readmitted] = events(run_dir, "node_readmitted")
        assert readmitted["node"] == "nb"

        until.write_text("1")  # finish the job
        assert a.wait(timeout=90) == 0, a.stderr[-3000:]
        assert c.wait(timeout=90) == 0, c.stderr[-3000:]
        assert b3.wait(timeout=90) == 0, b3.stderr[-3000:]  # a released spare
    finally:
        for agent in agents:
            agent.kill()
        for s in servers.values():
            s.__exit__(None, None, None)
    assert (run_dir / "done").exists()
    finished = {(e["node"], e["state"]) for e in events(run_dir, "job_finished")}
    assert {("na", "succeeded"), ("nc", "succeeded"), ("nb", "evicted")} <= finished
    [decision] = [d for d in events(run_dir, "recovery_decision") if d["action"] == "evict"]
    assert decision["node"] == "nb" and decision["reason"].startswith("health: ")
