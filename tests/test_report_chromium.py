"""``trainguard report`` of a run whose worker was kill -9'ed and restarted, opened in headless
Chromium: no console errors, rendered SVG plots, failure markers present."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch_utils import REPO, base_env, popen
from tests.services.telemetry_services import chromium_dump_dom, wait_until

pytestmark = pytest.mark.chromium

GRPO = str(REPO / "examples" / "grpo_toy.py")


def _steps_done(run_dir: Path, rank: int) -> int:
    path = run_dir / "metrics" / f"rank_{rank}.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"kind":"step"' in line)


def _worker_pid(run_dir: Path, rank: int) -> int | None:
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev["kind"] == "workers_started":
            for w in ev["workers"]:
                if w["rank"] == rank:
                    return int(w["pid"])
    return None


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-process GRPO run; rank 1 gets SIGKILL from outside after 8 steps; one restart
    resumes from the last checkpoint. Small batches (the cost is the 4 worker starts, not the
    steps); the step sleep leaves the test >= 2 s to kill rank 1 before it ends."""
    tmp = tmp_path_factory.mktemp("killed")
    run_dir = tmp / "run"
    proc = popen(
        "trainguard",
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--tg-run-dir", str(run_dir), GRPO, "--steps", "24", "--prompts", "4", "--group", "8",
         "--step-sleep", "0.15", "--ckpt", str(tmp / "ckpt.pt"), "--ckpt-every", "4"],
        cwd=tmp, env=base_env(),
    )  # fmt: skip
    try:
        wait_until(lambda: _steps_done(run_dir, 1) >= 8, 120, "rank 1 at step 8")
        pid = _worker_pid(run_dir, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    kinds = [json.loads(line)["kind"] for line in (run_dir / "events.jsonl").open()]
    assert "worker_failed" in kinds and "restart" in kinds
    return run_dir


def test_report_cli_writes_self_contained_html(killed_run: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", str(killed_run)],
        capture_output=True, text=True, timeout=120, env=base_env(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip().splitlines()[-1])
    assert path == killed_run / "report.html"
    assert "computing goodput" in r.stderr  # progress on stderr
    html = path.read_text()
    assert "<script" not in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "@import" not in html and "url(" not in html
    for section in ("training", "speed", "goodput", "timeline", "heatmap", "failures", "health"):
        assert f'id="{section}"' in html
    assert "SIGKILL" in html


def test_report_renders_in_headless_chromium(killed_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    r = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", "-q", str(killed_run), "-o", str(out)],
        capture_output=True, text=True, timeout=120, env=base_env(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    dom, log = chromium_dump_dom(out, tmp_path)
    console = [ln for ln in log.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert not console, console
    assert "Refused to" not in log  # no blocked (network) resource
    assert "</html>" in dom and "trainguard run report" in dom
    svgs = re.findall(r"<svg\b.*?</svg>", dom, flags=re.S)
    assert len(svgs) >= 8
    paths = re.findall(r'<path d="(M[^"]+)"', dom)
    assert len(paths) >= 6 and all(len(p) > 20 for p in paths)  # loss/reward/KL curves drawn
    failure_markers = re.findall(r'class="tg-glyph tg-failure"', dom)
    assert failure_markers, "no failure marker on the timeline"
    assert re.search(r'class="tg-glyph tg-restart"', dom)
    assert re.search(r'class="tg-glyph tg-checkpoint"', dom)
    assert re.search(r'class="tg-marker tg-restart"', dom)  # restart line on the curves
    assert 'class="tg-failure-row"' in dom
    assert "rank 1" in dom and "tg-heatmap" in dom
