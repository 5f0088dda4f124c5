"""The documented command line end to end: ``trainguard run --tg-role "rollout=2:python -m
trainguard.rl.engine" examples/rl_fleet.py`` with 2 trainer ranks and 2 real engines started
by the node agent and a warm standby (``standby=1``). An engine killed -9 mid-run is replaced
by the standby on its port, which serves only once it holds the current weights (the trainer
keeps its attempt and PIDs); each of two reward servers (``$TRAINGUARD_REWARD_URLS``) is killed
-9 in turn, scoring going on on the other. Every prompt is trained on exactly once, in the
fault-free order, through these faults (on-policy; tests/test_rl_resume.py: the async mode
through trainer kills). Every per-step figure of the rollout fleet reaches the agent's
Prometheus endpoint through the metric contract, and the HTML report's engine-fleet section."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fleet_engines import LocalEngines
from tests.launch_utils import REPO, base_env, popen
from tests.procs import alive, kill_tree
from trainguard.core.contracts.metrics import by_name
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import read_events
from trainguard.rl import ConsumedLog, PromptLedger, audit
from trainguard.telemetry.report import write_report
from trainguard.testing.ports import free_port

RL_FLEET = str(REPO / "examples" / "rl_fleet.py")
PROMPTS, BATCH = 16, 4  # an epoch every 4 steps

STEP_KEYS = (
    "reward", "reward_std", "kl", "entropy", "response_length", "rollout_tokens_per_s",
    "rollout_latency_p50_s", "rollout_latency_p99_s", "engines_serving", "engines_total",
    "weight_sync_s", "weight_sync_timeout_s", "staleness_max", "staleness_mean",
    "rollout_retries", "rollout_failed",
)  # fmt: skip
"""What the example logs every step (point by point: reward mean/std, KL, entropy, response
length, tokens/s, latency p50/p99, engines serving/total, weight sync, staleness, retries
and failures)."""

PER_RANK = (
    "trainguard.rl.reward.mean", "trainguard.rl.reward.std", "trainguard.rl.kl",
    "trainguard.rl.entropy", "trainguard.rl.response_length.mean",
    "trainguard.rl.rollout.throughput", "trainguard.rl.rollout.latency.p50",
    "trainguard.rl.rollout.latency.p99", "trainguard.rl.rollout.engines_routable",
    "trainguard.rl.rollout.engines_declared", "trainguard.rl.weight_sync.duration",
    "trainguard.rl.weight_sync.timeout", "trainguard.rl.staleness.max",
    "trainguard.rl.staleness.mean", "trainguard.rl.rollout.retries",
)  # fmt: skip


def wait_for(what: str, cond: Callable[[], Any], job: subprocess.Popen[str], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if job.poll() is not None:
            raise AssertionError(f"the job ended ({job.returncode}) before {what}")
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.2)


def engines(run: Path) -> list[dict[str, Any]] | None:
    states = RunDir(run).role_states().get("rollout", [])
    return states if len(states) == 2 and all(s["state"] == "serving" for s in states) else None


def records(run: Path, rank: int) -> list[dict[str, Any]]:
    out = []
    for line in (run / "metrics" / f"rank_{rank}.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line torn by the stop
            continue
    return out


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for m in re.finditer(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2] or ""))
        out.setdefault(m[1], []).append((labels, float(m[3])))
    return out


def standby(run: Path) -> dict[str, Any] | None:
    path = RunDir(run).role_standby("rollout", 0, "json")
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if state["state"] == "standby" else None


@pytest.mark.slow  # 2 trainer ranks and 4 engine starts (torch + transformers each)
def test_rl_fleet_job_with_engines_as_a_role(tmp_path: Path) -> None:
    run, prom_port = tmp_path / "run", free_port()
    rewards = LocalEngines(
        [free_port(), free_port()], run_dir=tmp_path / "reward", role="reward",
        module="trainguard.rl.reward", args=["--function", "trainguard.rl.tiny:digit_reward"],
    )  # fmt: skip
    rewards.start()
    engine = f"{sys.executable} -m trainguard.rl.engine --poll-interval-s 0.3"
    env = base_env(
        OMP_NUM_THREADS="1",
        TRAINGUARD_HEALTH_ENABLED="0",
        TRAINGUARD_ROLES_PROBE_INTERVAL_S="0.25",
        TRAINGUARD_ROLES_PROBE_TIMEOUT_S="2.0",
        TRAINGUARD_TELEMETRY_PROMETHEUS_PORT=str(prom_port),
        TRAINGUARD_TELEMETRY_POLL_INTERVAL_S="0.2",
        TRAINGUARD_REWARD_URLS=",".join(rewards.urls),
        TRAINGUARD_REWARD_TOKEN=rewards.token,
    )
    job = popen(
        "trainguard",
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--no-tg-warm",
         "--tg-run-dir", str(run), "--tg-role", f"rollout=2,standby=1:{engine}", RL_FLEET,
         "--steps", "100000", "--prompts", str(PROMPTS), "--batch", str(BATCH),
         "--step-sleep", "0.05", "--request-timeout", "20"],
        cwd=tmp_path, env=env,
    )  # fmt: skip
    consumed = ConsumedLog(run / "rl" / "consumed.jsonl")

    def steps_done() -> int:
        return max(consumed.effective(), default=-1) + 1

    err = ""
    try:
        first = wait_for("both engines serving", lambda: engines(run), job, 240)
        spare = wait_for("the standby ready", lambda: standby(run), job, 240)
        wait_for("two trained steps", lambda: steps_done() >= 2, job, 240)
        os.kill(first[0]["pid"], signal.SIGKILL)  # an engine dies mid-run
        rewards.kill(0, signal.SIGKILL)  # scoring goes on on the other reward server
        now = steps_done()
        again = wait_for(
            "engine 0 replaced and serving",
            lambda: (s := engines(run)) and s[0]["pid"] != first[0]["pid"] and s,
            job,
            240,
        )
        assert again[1]["pid"] == first[1]["pid"]  # the other engine was not touched
        assert again[0]["pid"] == spare["pid"]  # the warm standby took its place
        rewards.start(0)
        rewards.wait_serving(0, timeout=120)
        rewards.kill(1, signal.SIGKILL)  # and now on the restarted one
        later = steps_done()
        wait_for("more steps", lambda: steps_done() >= max(now + 3, later + 2), job, 240)
        serving = by_name("trainguard.role.replicas.serving").prometheus

        def fleet_whole() -> dict[str, Any] | None:
            # a probe answered late on this loaded box makes a replica suspect for a moment
            m = scrape(prom_port)
            return (
                m
                if [v for lab, v in m.get(serving, []) if lab.get("role") == "rollout"] == [2]
                else None
            )

        metrics = wait_for("the serving gauge back at 2", fleet_whole, job, 60)
        # the replacement served the trainer's weights from its first answer, not version 0
        assert again[0]["weight_version"] >= now
    finally:
        try:
            if job.poll() is None:
                job.send_signal(signal.SIGINT)  # stop it like a user would
            try:
                _, err = job.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                kill_tree(job.pid)
                _, err = job.communicate(timeout=30)
        finally:
            rewards.close()
    assert not alive(again[0]["pid"]) and not alive(again[1]["pid"]), err[-3000:]

    # the trainer never restarted: one attempt, the engine restarted alone
    events = list(read_events(run))
    assert [e for e in events if e["kind"] == "restart"] == [], err[-3000:]
    failed = [e for e in events if e["kind"] == "role_replica_failed"]
    assert [(e["replica"], e["pid"]) for e in failed] == [(0, first[0]["pid"])]
    # refit-gated: the promoted standby's first "serving" already held the trainer's version
    promoted = [
        e
        for e in events
        if e["kind"] == "role_replica_state" and e["replica"] == 0 and e["pid"] == spare["pid"]
    ]
    assert promoted[0]["state"] == "starting"
    assert next(e for e in promoted if e["state"] == "serving")["weight_version"] >= now
    assert [e["state"] for e in events if e["kind"] == "role_standby_state"][:3] == [
        "starting", "standby", "promoted"
    ]  # fmt: skip
    assert {e["attempt"] for e in events if e["kind"] == "rl_trainer_attached"} == {0}

    # exactly once, in the fault-free order, through the engine and reward server kills
    result = audit(consumed, PROMPTS)
    assert result.steps >= later + 2 and (result.skipped, result.duplicated) == (0, 0)
    ledger = PromptLedger(PROMPTS, seed=0)
    assert result.sequence == [ledger.prompt_id(g) for g in range(result.steps * BATCH)]

    # every step's figures, logged by both ranks, all from real generations
    for rank in (0, 1):
        recs = [r for r in records(run, rank) if r.get("kind") == "log" and "reward" in r]
        assert len(recs) >= 5
        for r in recs:
            missing = [k for k in STEP_KEYS if k not in r]
            assert not missing, (missing, r)
            assert r["samples_real"] == r["samples_trained"] and r["engines_total"] == 2
            assert r["staleness_max"] == 0  # on-policy

    # the agent's Prometheus endpoint: the contract's names, per rank, and the fleet gauges
    def value(name: str, **labels: str) -> float:
        got = [
            v
            for lab, v in metrics.get(by_name(name).prometheus, [])
            if labels.items() <= lab.items()
        ]
        assert got, (name, labels, sorted(k for k in metrics if "_rl_" in k or "_role_" in k))
        return got[0]

    for name in PER_RANK:
        for rank in ("0", "1"):
            value(name, rank=rank)
    assert value("trainguard.rl.rollout.engines_declared", rank="0") == 2
    assert value("trainguard.role.replicas.serving", role="rollout") == 2
    assert value("trainguard.role.replicas.total", role="rollout") == 2
    assert value("trainguard.role.restarts", role="rollout") == 1
    assert value("trainguard.role.replica.weight_version", role="rollout", replica="0") >= now
    for counter in ("trainguard.rl.rollout.failed", "trainguard.rl.rollout.retried"):
        reasons = {lab["reason"] for lab, _ in metrics[by_name(counter).prometheus]}
        assert {"refused", "engine_dead", "malformed", "timeout"} <= reasons  # from 0

    # the report: the trainer's attempt beside each engine's states, and the rollout charts
    html = write_report(run).read_text()
    fleet = html.split('<div id="fleet">', 1)[1].split("<h2>", 1)[0]
    lanes = fleet.split('class="tg-ytick">')[1:]
    assert [ln.split("<", 1)[0] for ln in lanes[:3]] == ["trainer", "rollout 0", "rollout 1"]
    assert 'class="tg-role-dead"' in lanes[1] and 'class="tg-role-dead"' not in lanes[2]
    for title in ("Rollout tokens/s", "Rollout latency p50 / p99 (s)", "Engines routable / total",
                  "Weight sync (s)", "Staleness (versions)"):  # fmt: skip
        assert f"<title>{title}</title>" in fleet, title
