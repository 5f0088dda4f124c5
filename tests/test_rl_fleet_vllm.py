"""An RL job on real vLLM engines (``make test-engines``): ``trainguard run`` with the
``rollout`` role ``python -m trainguard.rl.engines.vllm`` (2 replicas and a warm standby),
``examples/rl_fleet.py --model tiny-llama`` as the trainer. One refit is made to fail inside vLLM
(a tensor of a wrong shape: vLLM answers 500 mid-update and its engine dies; the adapter exits
and the replica is replaced), one engine is killed -9, one is frozen with SIGSTOP (declared
dead, replaced): the trainer never restarts, every prompt is trained on exactly once in the
fault-free order, every trained sample came from an engine at the trainer's version."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.launch_utils import base_env, popen
from tests.procs import kill_tree
from tests.test_rl_fleet_job import RL_FLEET, engines, records, standby, wait_for
from tests.vllm_engine import http_json, require_vllm
from trainguard.core.events import read_events
from trainguard.core.fleetauth import load_secret_file, role_token, secret_path
from trainguard.rl import ConsumedLog, PromptLedger, audit
from trainguard.rl.engines.launch import adapter_command

pytestmark = [pytest.mark.engines, pytest.mark.timeout(5400)]  # 6 vLLM starts on 2 cores

PROMPTS, BATCH = 16, 4


def test_rl_job_on_vllm_engines_through_a_failed_refit_a_kill_and_a_freeze(tmp_path: Path) -> None:
    py = require_vllm()
    run = tmp_path / "run"
    adapter = shlex.join(adapter_command("--enable-fault-injection", "--poll-interval-s", "0.3"))
    env = base_env(
        OMP_NUM_THREADS="1",
        TRAINGUARD_HEALTH_ENABLED="0",
        TRAINGUARD_ROLES_PROBE_INTERVAL_S="0.5",
        TRAINGUARD_ROLES_PROBE_TIMEOUT_S="3.0",
        TRAINGUARD_VLLM_PYTHON=py,
        VLLM_CPU_OMP_THREADS_BIND="nobind",  # several engines on 2 cores: no pinning to core 0
    )
    job = popen(
        "trainguard",
        ["--standalone", "--nproc-per-node", "1", "--max-restarts", "2", "--no-tg-warm",
         "--tg-run-dir", str(run),
         "--tg-role", f"rollout=2,standby=1,ready=1200,budget=4:{adapter}", RL_FLEET,
         "--model", "tiny-llama", "--steps", "100000", "--prompts", str(PROMPTS),
         "--batch", str(BATCH), "--group", "2", "--step-sleep", "0.5",
         "--request-timeout", "60", "--max-attempts", "12", "--serving-timeout", "1500"],
        cwd=tmp_path, env=env,
    )  # fmt: skip
    consumed = ConsumedLog(run / "rl" / "consumed.jsonl")

    def steps_done() -> int:
        return max(consumed.effective(), default=-1) + 1

    def health(port: int) -> dict[str, Any] | None:
        try:
            code, h = http_json(port, "GET", "/health", timeout=5, token=job_token(run))
        except OSError:
            return None
        return h if code == 200 else None

    err = ""
    try:
        first = wait_for("both engines serving", lambda: engines(run), job, 1500)
        wait_for("two trained steps", lambda: steps_done() >= 2, job, 600)
        ports = [s["port"] for s in first]

        # 1. a refit that vLLM fails mid-update on engine 1: the adapter answers 500 in one
        # line and exits; the replica is replaced and serves the trainer's version
        body = {"kind": "refit_500", "count": 1}
        code, _ = http_json(ports[1], "POST", "/v1/faults", body, token=job_token(run))
        assert code == 200
        refit_failed = wait_for(
            "engine 1 replaced after its failed refit",
            lambda: (s := engines(run)) and s[1]["pid"] != first[1]["pid"] and s,
            job,
            1500,
        )
        log = (run / "roles" / "rollout" / "1.log").read_text(errors="replace")
        line = next(ln for ln in log.splitlines() if "could not load it" in ln)
        assert "replica 1" in line and "restarts" in line
        now = steps_done()
        wait_for("a step after it", lambda: steps_done() >= now + 1, job, 600)

        # 2. engine 0 killed -9: the warm standby takes its port
        spare = wait_for("a standby ready", lambda: standby(run), job, 1500)
        os.kill(first[0]["pid"], signal.SIGKILL)
        again = wait_for(
            "engine 0 replaced and serving",
            lambda: (s := engines(run)) and s[0]["pid"] != first[0]["pid"] and s,
            job,
            600,
        )
        assert again[0]["pid"] == spare["pid"]
        assert again[1]["pid"] == refit_failed[1]["pid"]  # the other engine was not touched
        now = steps_done()
        wait_for("a step after the kill", lambda: steps_done() >= now + 1, job, 600)

        # 3. engine 1 frozen: declared dead, killed, replaced; the job goes on meanwhile
        frozen = again[1]["pid"]
        os.kill(frozen, signal.SIGSTOP)
        wait_for("steps while engine 1 is frozen", lambda: steps_done() >= now + 3, job, 600)
        final = wait_for(
            "engine 1 replaced and serving",
            lambda: (s := engines(run)) and s[1]["pid"] != frozen and s,
            job,
            1500,
        )
        later = steps_done()
        wait_for("more steps", lambda: steps_done() >= later + 2, job, 600)
    finally:
        try:
            if job.poll() is None:
                job.send_signal(signal.SIGINT)
            try:
                _, err = job.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                kill_tree(job.pid)
                _, err = job.communicate(timeout=30)
        finally:
            for pid in _role_pids(run):
                try:
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    events = list(read_events(run))
    assert [e for e in events if e["kind"] == "restart"] == [], err[-3000:]
    dead = [(e["replica"], e["pid"]) for e in events if e["kind"] == "role_replica_failed"]
    assert {(1, first[1]["pid"]), (0, first[0]["pid"]), (1, frozen)} <= set(dead), dead
    assert final[0]["weight_version"] >= later - 2

    result = audit(consumed, PROMPTS)
    assert result.steps >= later + 2 and (result.skipped, result.duplicated) == (0, 0)
    ledger = PromptLedger(PROMPTS, seed=0)
    assert result.sequence == [ledger.prompt_id(g) for g in range(result.steps * BATCH)]
    recs = [r for r in records(run, 0) if r.get("kind") == "log" and "reward" in r]
    assert len(recs) >= 5
    for r in recs:
        assert r["samples_real"] == r["samples_trained"] and r["staleness_max"] == 0
    assert sum(r.get("weight_sync_missed", 0) for r in recs) >= 1  # the failed refit


def job_token(run: Path) -> str:
    """The job's ``rollout`` token (the agent wrote the job secret into the run directory)."""
    return role_token(load_secret_file(secret_path(run)), "rollout")


def _role_pids(run: Path) -> list[int]:
    pids = []
    for f in (run / "roles").glob("*/*.json"):
        try:
            pids.append(int(json.loads(f.read_text())["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    time.sleep(0)
    return pids
