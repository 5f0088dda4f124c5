"""Failure attribution in real jobs: `trainguard run` with 2 gloo ranks running a plain script
(no trainguard import, no ``@record``; tests/workers/faulty.py).

- the same exception at the same place on every rank: the job stops at once (exit 93, no
  restart spent), and the exception, its file:line and the ranks are in the events and the
  summary, whose time accounting adds up;
- the exception on one rank only: one restart, then (the same place again) the stop;
- a flaky exception on the first attempt only: restarted, the job finishes — a transient fault
  never stops a job (a rank killed with SIGKILL: tests/test_demo_output.py, on the demo's job).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.launch_utils import base_env, launch
from trainguard.core.failures import DO_NOT_REQUEUE_EXIT_CODE
from trainguard.telemetry.report import write_report

FAULTY = Path(__file__).resolve().parent / "workers" / "faulty.py"


def run_job(tmp_path: Path, fault: str, *extra: str) -> tuple[int, str, list[dict]]:
    run_dir = tmp_path / fault
    env = base_env(
        TRAINGUARD_TELEMETRY_ENABLED="false",
        TRAINGUARD_CHECKPOINT_MEMORY_TIER="false",
        TRAINGUARD_RECOVERY_BACKOFF_BASE_S="0",
    )
    r = launch(
        "trainguard",
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
         "--monitor-interval", "0.1", "--tg-run-dir", str(run_dir), str(FAULTY),
         "--fault", fault, *extra],
        cwd=tmp_path, env=env, timeout=400,
    )  # fmt: skip
    evs = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return r.returncode, r.stderr, evs


def kinds(evs: list[dict], kind: str) -> list[dict]:
    return [e for e in evs if e["kind"] == kind]


def summary_total(stderr: str) -> tuple[float, float]:
    """(wall time, sum of the accounted parts) of the summary's goodput line."""
    head = next(line for line in stderr.splitlines() if line.startswith("trainguard run: "))
    m = re.search(r"goodput ([\d.]+) % of ([\d.]+) s(?: \(lost: (.*)\))?", head)
    assert m is not None, head
    total = float(m.group(2))
    lost = sum(float(v) for v in re.findall(r" ([\d.]+) s", m.group(3) or ""))
    return total, lost + total * float(m.group(1)) / 100


def test_deterministic_user_error_stops_without_restarts(tmp_path: Path) -> None:
    rc, err, evs = run_job(tmp_path, "shape")
    assert rc == DO_NOT_REQUEUE_EXIT_CODE, err[-3000:]
    assert not kinds(evs, "restart"), "a restart was spent on a deterministic error"
    (a,) = kinds(evs, "failure_attributed")
    assert (a["cause"], a["verdict"], a["deterministic"]) == ("user_code", "stop", True)
    assert a["evidence"]["exception"] == "RuntimeError"
    assert a["evidence"]["place"] == f"{FAULTY}:32" and a["ranks"] == [0, 1]
    failed = kinds(evs, "worker_failed")
    assert {f["place"] for f in failed} == {f"{FAULTY}:32"}
    assert "shapes cannot be multiplied" in (failed[0]["message"] or "")
    (stop,) = [d for d in kinds(evs, "recovery_decision") if d["action"] == "stop"]
    assert stop["verdict"] == "stop" and "faulty.py:32" in stop["reason"]
    assert "1 failure seen; job stopped" in err and "recovered" not in err
    assert "verdict stop (user_code: RuntimeError" in err and "faulty.py:32 on rank(s) 0,1" in err
    total, parts = summary_total(err)
    assert abs(total - parts) <= 0.2 + 0.001 * total, (total, parts)
    html = Path(write_report(tmp_path / "shape")).read_text()
    assert 'class="tg-verdict-row"' in html and "faulty.py:32" in html


def test_user_error_on_one_rank_is_restarted_once(tmp_path: Path) -> None:
    rc, err, evs = run_job(tmp_path, "shape-rank0")
    assert rc == DO_NOT_REQUEUE_EXIT_CODE, err[-3000:]
    verdicts = [(a["failed_attempt"], a["verdict"]) for a in kinds(evs, "failure_attributed")]
    assert verdicts[0] == (0, "restart") and verdicts[-1] == (1, "stop"), verdicts
    assert len(kinds(evs, "restart")) == 1
    assert "two failed attempts in a row" in err
    total, parts = summary_total(err)
    assert abs(total - parts) <= 0.2 + 0.001 * total, (total, parts)


def test_transient_faults_are_restarted(tmp_path: Path) -> None:
    """A flaky exception on rank 0's first attempt only: not deterministic (rank 1 did not
    raise), restarted once, the job finishes. A SIGKILLed rank (transient) restarted once in a
    finished job is test_demo_output's, on the demo's job; classified, test_recovery_attribution's
    test_transient_faults_never_stop."""
    rc, err, evs = run_job(tmp_path, "flaky")
    assert rc == 0, err[-3000:]
    attrs = kinds(evs, "failure_attributed")
    assert attrs and all(a["verdict"] != "stop" for a in attrs), attrs
    assert len(kinds(evs, "restart")) == 1
    assert "1 failure recovered" in err
    assert attrs[0]["cause"] == "user_code" and not attrs[0]["deterministic"]


def test_two_nodes_same_user_error_stop_without_restarts(tmp_path: Path) -> None:
    """Two agents (c10d rendezvous), one rank each: neither sees every rank; the ranks counted
    in the job's store complete it and the job stops on both nodes without a restart."""
    from tests.launch_utils import free_port, wait_listening
    from tests.procs import kill_tree

    port, run_dir = free_port(), tmp_path / "two"
    env = base_env(
        TRAINGUARD_TELEMETRY_ENABLED="false",
        TRAINGUARD_CHECKPOINT_MEMORY_TIER="false",
        TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0",
        TRAINGUARD_HEALTH_MIN_FREE_DISK_GIB="0",
        TRAINGUARD_HEALTH_MIN_FREE_MEMORY_GIB="0",
        TRAINGUARD_RECOVERY_BACKOFF_BASE_S="0",
        # how long the first node waits for the other's count: generous on a loaded CI box
        TRAINGUARD_RECOVERY_FAILURE_GRACE_S="10",
    )
    procs = {}
    try:
        for node in ("n0", "n1"):
            procs[node] = subprocess.Popen(
                [sys.executable, "-m", "trainguard", "run", "--nnodes", "2", "--nproc-per-node",
                 "1", "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                 f"127.0.0.1:{port}", "--rdzv-id", "two", "--tg-run-dir", str(run_dir),
                 str(FAULTY), "--fault", "shape"],
                cwd=tmp_path, env={**env, "SLURMD_NODENAME": node}, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                start_new_session=True,
            )  # fmt: skip
            if node == "n0":
                wait_listening(port)
        codes = {n: p.wait(timeout=300) for n, p in procs.items()}
        errs = {n: p.stderr.read() if p.stderr else "" for n, p in procs.items()}
    finally:
        for p in procs.values():
            kill_tree(p)
    assert codes == {"n0": DO_NOT_REQUEUE_EXIT_CODE, "n1": DO_NOT_REQUEUE_EXIT_CODE}, errs
    evs = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    # no worker restarted (an agent may have begun its restart before it learned the stop)
    assert len(kinds(evs, "workers_started")) == 2, kinds(evs, "workers_started")
    attrs = kinds(evs, "failure_attributed")
    assert {a["node"] for a in attrs} == {"n0", "n1"}
    assert any(a["verdict"] == "stop" and "of the job" in a["summary"] for a in attrs), attrs
