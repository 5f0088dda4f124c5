"""Straggler scores: the scorer's logic, and real 2-process jobs (one slow rank, a clean run)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.health_fixtures.jobs import events, job_env, node_cmd, run_job
from tests.launch_utils import free_port, steps_done, wait_listening
from trainguard.core.config.health import HealthConfig
from trainguard.health.straggler import StragglerScorer

CFG = dict(straggler_min_delta_s=0.005)


def feed(scorer: StragglerScorer, steps: range, times: dict[int, float]) -> list[dict]:
    found = []
    for s in steps:
        for r, t in times.items():
            scorer.add(r, s, t)
        found += scorer.evaluate()
    return found


def test_scores_against_the_others_median() -> None:
    sc = StragglerScorer(HealthConfig(**CFG), [0, 1, 2, 3])
    found = feed(sc, range(40), {0: 0.1, 1: 0.1, 2: 0.15, 3: 0.1})
    assert [f["rank"] for f in found] == [2]
    assert abs(found[0]["score"] - (1 - 0.1 / 0.15)) < 1e-3
    assert found[0]["step"] <= 30
    assert sc.scores[0] == 0.0 and abs(sc.scores[2] - 0.3333) < 1e-3


def test_warmup_and_blips_are_not_stragglers() -> None:
    sc = StragglerScorer(HealthConfig(**CFG), [0, 1])
    # rank 1 compiles slowly for the first 3 steps, then a one-step hiccup at step 20.
    for s in range(100):
        sc.add(0, s, 0.1)
        sc.add(1, s, 5.0 if s < 3 or s == 20 else 0.1)
        assert sc.evaluate() == []


def test_noise_below_min_delta_is_ignored() -> None:
    sc = StragglerScorer(HealthConfig(straggler_min_delta_s=0.05), [0, 1])
    assert feed(sc, range(60), {0: 0.004, 1: 0.008}) == []  # 2x, but 4 ms
    low = HealthConfig(straggler_min_delta_s=0.001)
    assert feed(StragglerScorer(low, [0, 1]), range(60), {0: 0.004, 1: 0.008})


def test_single_rank_has_no_straggler() -> None:
    sc = StragglerScorer(HealthConfig(**CFG), [0])
    assert feed(sc, range(50), {0: 1.0}) == []


def test_local_rank_slow_against_the_remote_median_is_reported() -> None:
    # One local rank: only the other nodes' medians make a comparison possible.
    sc = StragglerScorer(HealthConfig(**CFG), [1])
    assert feed(sc, range(20), {1: 0.15}) == []  # nobody to compare with yet
    assert sc.latest == {1: 0.15} and sc.latest_step == 19
    sc.set_remote({0: 0.1, 2: 0.1, 3: 0.1})
    found = feed(sc, range(20, 40), {1: 0.15})
    assert [f["rank"] for f in found] == [1]
    assert abs(found[0]["score"] - (1 - 0.1 / 0.15)) < 1e-3
    assert found[0]["median_others_s"] == 0.1 and found[0]["ranks_compared"] == 4


def test_remote_straggler_is_not_reported_by_this_node() -> None:
    sc = StragglerScorer(HealthConfig(**CFG), [0, 1])
    sc.set_remote({2: 0.3, 3: 0.1})  # rank 2 (elsewhere) is slow: its node's business
    assert feed(sc, range(60), {0: 0.1, 1: 0.1}) == []
    assert sc.scores == {0: 0.0, 1: 0.0}
    # A local rank listed among the remote ones is ignored (no self-comparison).
    sc.set_remote({0: 0.01, 2: 0.1})
    assert sc.remote == {2: 0.1}


def test_straggler_policy_is_validated() -> None:
    assert HealthConfig().straggler_policy == "report"
    assert HealthConfig(straggler_policy="exclude").straggler_policy == "exclude"
    with pytest.raises(ValueError, match="straggler_policy"):
        HealthConfig(straggler_policy="drain")  # type: ignore[arg-type]


def test_clean_200_step_run_reports_none(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    p = run_job(
        run_dir,
        ["--steps", "200", "--compute-s", "0.02", "--sleep"],
        env=job_env(straggler_min_delta_s=0.005),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert events(run_dir, "straggler_detected") == []
    scores = json.loads(next((run_dir / "health").glob("straggler_scores.*.json")).read_text())
    assert scores["stragglers"] == [] and set(scores["scores"]) == {"0", "1"}


SLOW_RANK_1 = ["--compute-s", "0.08", "--sleep", "--slow-rank", "1", "--slow-factor", "1.5"]
SLOW_NODE_1 = ["--compute-s", "0.08", "--sleep", "--slow-node", "node1", "--slow-factor", "1.5"]
"""node1's rank slow, whichever global rank the rendezvous gave it (the rendezvous orders the
agents by address and pid, and pids wrap: node1's agent can get rank 0)."""


def start_nodes(
    tmp_path: Path,
    run_dir: Path,
    worker_args: list[str],
    *,
    nodes: int = 2,
    cmd_kw: dict[str, object] | None = None,
    **kw: object,
) -> list[subprocess.Popen[str]]:
    """One `trainguard run` per node; node0 hosts the rendezvous store (started first)."""
    port = free_port()
    procs = []
    for n in range(nodes):
        env = job_env(straggler_min_delta_s=0.005, probe_interval_s=0, **kw)
        env["SLURMD_NODENAME"] = f"node{n}"
        cmd = node_cmd(run_dir, worker_args, port=port, **(cmd_kw or {}))  # type: ignore[arg-type]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=tmp_path,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        )
        if n == 0:
            wait_listening(port)
    return procs


def finish(procs: list[subprocess.Popen[str]], timeout: float = 90) -> list[str]:
    try:
        return [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()


def node_of_rank(run_dir: Path) -> dict[int, str]:
    return {w["rank"]: e["node"] for e in events(run_dir, "workers_started") for w in e["workers"]}


def test_two_nodes_one_rank_each_compare_across_nodes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    procs = start_nodes(tmp_path, run_dir, ["--steps", "40", *SLOW_RANK_1])
    errs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    where = node_of_rank(run_dir)
    assert sorted(where.values()) == ["node0", "node1"]
    found = events(run_dir, "straggler_detected")
    assert [(e["rank"], e["node"]) for e in found] == [(1, where[1])], found
    assert found[0]["step"] < 30 and 0.2 <= found[0]["score"] <= 0.45
    assert found[0]["ranks_compared"] == 2
    # Each node scored only its own rank, against the other node's published median.
    for rank, node in where.items():
        scores = json.loads((run_dir / "health" / f"straggler_scores.{node}.json").read_text())
        assert set(scores["scores"]) == {str(rank)} and scores["node"] == node
        other = 1 - rank
        assert scores["remote_medians_s"][str(other)]["node"] == where[other]
        assert scores["stragglers"] == ([1] if rank == 1 else [])


def test_exclude_policy_takes_the_node_out_with_a_one_line_message(tmp_path: Path) -> None:
    """One node, two ranks, rank 1 slow: reported within 30 steps against the local median,
    then the node leaves the job (the report policy: the two-node test above)."""
    run_dir = tmp_path / "run"
    env = job_env(straggler_min_delta_s=0.005, straggler_policy="exclude", probe_interval_s=0)
    env["SLURMD_NODENAME"] = "nodeA"
    p = run_job(run_dir, ["--steps", "200", *SLOW_RANK_1], env=env)
    assert p.returncode == 1, p.stderr[-3000:]
    [found] = events(run_dir, "straggler_detected")
    assert found["rank"] == 1 and found["step"] < 30
    assert 0.2 <= found["score"] <= 0.45
    scores = json.loads(next((run_dir / "health").glob("straggler_scores.*.json")).read_text())
    assert scores["stragglers"] == [1] and scores["scores"]["1"] > scores["scores"]["0"]
    [excl] = events(run_dir, "node_excluded")
    assert excl["node"] == "nodeA" and excl["reason"] == "straggler" and excl["ranks"] == [1]
    assert excl["scores"]["1"] == found["score"] and "rank 1 is a straggler" in excl["reasons"][0]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("trainguard run: node nodeA excluded: rank 1 is a straggler"), last
    assert "Traceback" not in p.stderr and "NodeUnhealthyError" not in p.stderr
    assert steps_done(run_dir) < 150  # it left mid-run
    [fin] = events(run_dir, "job_finished")
    assert fin["state"] == "excluded"


@pytest.mark.slow
def test_elastic_job_carries_on_without_the_excluded_node(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    procs = start_nodes(
        tmp_path,
        run_dir,
        ["--steps", "80", *SLOW_NODE_1],
        cmd_kw={
            "nnodes": "1:2",
            "max_restarts": 1,
            # last call: a loaded machine may start node1's agent many seconds after node0's,
            # and the first round must hold both (the re-rendezvous without node1 waits it out)
            "rdzv_conf": "last_call_timeout=20,keep_alive_interval=1,keep_alive_max_attempt=2",
        },
        straggler_policy="exclude",
    )  # node0 hosts the rendezvous store and outlives node1 (node1's rank is the slow one)
    errs = finish(procs, timeout=240)
    rcs = [p.returncode for p in procs]
    assert rcs == [0, 1], f"{rcs}\n" + errs[0][-3000:] + "\n----\n" + errs[1][-3000:]
    [excl] = events(run_dir, "node_excluded")
    # node1's rank in the first round (node0 is rank 0 alone after it)
    slow = next(
        w["rank"]
        for e in events(run_dir, "workers_started")
        if e["node"] == "node1"
        for w in e["workers"]
    )
    assert excl["node"] == "node1" and excl["ranks"] == [slow]
    assert (
        errs[1]
        .strip()
        .splitlines()[-1]
        .startswith(f"trainguard run: node node1 excluded: rank {slow}")
    )
    rdzv = [e for e in events(run_dir, "rendezvous") if e["node"] == "node0"]
    assert [e["group_world_size"] for e in rdzv] == [2, 1]
    assert (run_dir / "done").read_text() == "1"
