"""``trainguard plan``: JSON and HTML output, bad input, and ``--from-run`` on a real run with
an injected kill -9, held against the run's measured goodput."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch_utils import REPO, base_env
from trainguard.cli.cmd_plan import main
from trainguard.plan.model import CAUSES


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv), prog="trainguard plan")
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_answers_the_question(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _plan(capsys, "--gpus", "16384", "--mtti-h", "2.5", "--json")
    assert rc == 0
    plan = json.loads(out)
    rec = plan["recommendation"]
    assert rec["memory_interval_s"] > 0 and rec["disk_interval_s"] >= rec["memory_interval_s"]
    assert rec["spares"] >= 1 and 0.9 < rec["ettr"] < 1
    assert set(plan["estimate"]["badput_fraction"]) == set(CAUSES)
    assert plan["estimate"]["badput_fraction"]["requeue"] > 0
    assert {r["input"] for r in plan["sensitivity"]} >= {"MTTI", "restart", "detection"}
    llama = plan["scenarios"][0]
    assert llama["profiles"]["torchrun_like"]["ettr"] < llama["profiles"]["trainguard"]["ettr"]
    # a torchrun-like job at the same scale does worse than the recommendation
    rc, out, _ = _plan(capsys, "--gpus", "16384", "--mtti-h", "2.5", "--profile", "torchrun",
                       "--json", "--no-scenarios")  # fmt: skip
    assert rc == 0 and json.loads(out)["recommendation"]["ettr"] < rec["ettr"]


def test_given_intervals_are_evaluated_not_optimised(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--gpus", "4096", "--node-mtbf-h", "5000", "--no-scenarios", "--json", "--spares", "2"]
    rc, out, _ = _plan(capsys, *args, "--disk-interval-s", "3600", "--memory-interval-s", "60")
    assert rc == 0
    fixed = json.loads(out)
    assert fixed["recommendation"]["disk_interval_s"] == pytest.approx(3600)
    rc, out, _ = _plan(capsys, *args)
    best = json.loads(out)
    assert best["recommendation"]["ettr"] >= fixed["recommendation"]["ettr"]


def test_html_is_one_self_contained_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.html"
    rc, text, _ = _plan(capsys, "--gpus", "8192", "--mtti-h", "4", "--html", str(out))
    assert rc == 0 and "recommended" in text
    html = out.read_text()
    assert html.count("<svg") >= 4  # badput bar + three curves
    assert "ETTR vs disk interval" in html and "ETTR vs cluster size" in html
    lowered = html.lower()
    assert "<script" not in lowered and "src=" not in lowered and "href=" not in lowered
    assert "Llama 3.1" in html and "Assumptions" in html


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--mtti-h", "-1"], "--mtti-h must be > 0"),
        (["--node-mtbf-h", "-3"], "--node-mtbf-h must be > 0"),
        (["--restart-s", "-2"], "--restart-s"),
        (["--disk-interval-s", "1", "--disk-stall-s", "5"], "shorter than its checkpoint stall"),
        (["--memory-interval-s", "0.01", "--memory-stall-s", "1"], "memory interval"),
        (["--node-loss-fraction", "1.5"], "--node-loss-fraction"),
        (["--gpus", "100000", "--node-mtbf-h", "10"], "never finishes"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    rc, out, err = _plan(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_from_run_without_events(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _plan(capsys, "--from-run", str(tmp_path))
    assert rc == 2 and err.count("\n") == 1 and "no events" in err
    rc, _, err = _plan(capsys, "--from-run", str(tmp_path / "missing"))
    assert rc == 2 and "not a directory" in err


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-rank job, 80 steps of ~55 ms, the rank kill -9'd at step 40 and restarted: the
    example's training without DDP (``--no-ddp``; one rank, the planner reads a
    run's events and metrics whatever its size, DDP's import is ~2 CPU s a worker start)."""
    run_dir = tmp_path_factory.mktemp("plan") / "run"
    cmd = [sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "1",
           "--max-restarts", "3", "--tg-run-dir", str(run_dir), "examples/train_mlp.py",
           "--no-ddp", "--steps", "80", "--step-sleep", "0.05", "--fail-at-step", "40", "--fail-rank", "0"]  # fmt: skip
    p = subprocess.Popen(cmd, cwd=REPO, env=base_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        _, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, err[-2000:]
    return run_dir


def _measured_ettr(run_dir: Path) -> float:
    """Independently of the planner: trainguard's telemetry goodput of the run's records."""
    from trainguard.core.events import read_events
    from trainguard.core.goodput import compute_goodput

    recs = []
    for f in (run_dir / "metrics").glob("rank_*.jsonl"):
        recs += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    g = compute_goodput(list(read_events(run_dir)), recs)
    assert g.ettr is not None
    return g.ettr


@pytest.mark.slow
def test_from_run_reproduces_measured_goodput(
    failed_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = _plan(capsys, "--from-run", str(failed_run), "--json", "--no-scenarios")
    assert rc == 0
    run = json.loads(out)["run"]
    assert run["failures"] == 1
    costs = run["costs"]
    assert costs["memory_every_steps"] == 1 and costs["disk_every_steps"] == 20
    # the save at step 40 dies in flight with the worker; the restart from the memory tier at
    # step 40 persists it again (the disk keeps its cadence)
    from trainguard.core.events import read_events

    commits = [e for e in read_events(failed_run) if e["kind"] == "checkpoint_committed"]
    assert [e["step"] for e in commits] == [20, 40, 60, 80], commits
    assert costs["memory_restore_s"] is not None  # resumed from the memory tier
    assert costs["restart_s"] > 0.5 and costs["startup_s"] > 0.5
    measured = _measured_ettr(failed_run)
    assert 0.05 < measured < 0.9
    assert abs(run["model_ettr"] - measured) < 0.05, (run["model_ettr"], measured)
    # what auto_interval would learn from this run: its one restart came from memory
    from trainguard.checkpoint.interval import observed_memory_fraction

    assert observed_memory_fraction(failed_run) == 1.0
    # the run's costs at 16k GPUs: a plan, with the run's restore and restart costs in it
    rc, out, _ = _plan(capsys, "--from-run", str(failed_run), "--gpus", "16384", "--mtti-h",
                       "2.5", "--json", "--no-scenarios")  # fmt: skip
    assert rc == 0
    plan = json.loads(out)
    assert plan["inputs"]["gpus"] == 16384
    assert plan["inputs"]["restart_s"] == pytest.approx(costs["restart_s"])
    assert 0 < plan["recommendation"]["ettr"] < 1
