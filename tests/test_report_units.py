"""The HTML report on synthetic run directories (no browser): sections, markers, edge cases."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch_utils import REPO, base_env
from trainguard.core import svg
from trainguard.telemetry.report import load_run, render_report, write_report

T0 = 1_700_000_000.0


def _write(run: Path, events: list[dict], records: dict[int, list[dict]]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "metrics").mkdir(exist_ok=True)
    for rank, recs in records.items():
        (run / "metrics" / f"rank_{rank}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in recs) + '{"torn": '
        )


def _run(tmp_path: Path) -> Path:
    events = [
        {"time": T0, "kind": "launch", "node": "n", "attempt": 0},
        {"time": T0 + 1, "kind": "rendezvous", "node": "n", "attempt": 0, "duration_s": 0.5},
        {"time": T0 + 1.2, "kind": "workers_started", "node": "n", "attempt": 0},
        {"time": T0 + 3, "kind": "straggler_detected", "node": "n", "attempt": 0, "rank": 1,
         "message": "rank 1 is 3x slower"},
        {"time": T0 + 4, "kind": "hang_detected", "node": "n", "attempt": 0, "ranks": [1],
         "message": "rank 1 frozen"},
        {"time": T0 + 4.1, "kind": "worker_failed", "node": "n", "attempt": 0, "rank": 1,
         "cause": "hang", "signal": "SIGKILL", "exitcode": -9},
        {"time": T0 + 4.2, "kind": "restart", "node": "n", "attempt": 0, "reason": "failure"},
        {"time": T0 + 5, "kind": "rendezvous", "node": "n", "attempt": 1, "duration_s": 0.5},
        {"time": T0 + 5.2, "kind": "workers_started", "node": "n", "attempt": 1},
        {"time": T0 + 5.5, "kind": "checkpoint_restored", "node": "n", "attempt": 1, "rank": 0},
        {"time": T0 + 8, "kind": "job_finished", "node": "n", "attempt": 1, "state": "succeeded"},
    ]  # fmt: skip
    records: dict[int, list[dict]] = {0: [], 1: []}
    for rank in (0, 1):
        for i in range(4):
            records[rank].append({"time": T0 + 2 + 0.4 * i, "kind": "step", "rank": rank,
                                  "attempt": 0, "step": i, "step_time_s": 0.3, "tokens": 64,
                                  "flops": 1e9})  # fmt: skip
            records[rank].append({"kind": "log", "rank": rank, "step": i, "loss": 1.0 / (i + 1),
                                  "reward": 0.1 * i, "kl": 0.01 * i})  # fmt: skip
        for i in range(2, 6):
            records[rank].append({"time": T0 + 6 + 0.3 * i, "kind": "step", "rank": rank,
                                  "attempt": 1, "step": i, "step_time_s": 0.25, "tokens": 64,
                                  "flops": 1e9})  # fmt: skip
    run = tmp_path / "run"
    _write(run, events, records)
    (run / "config.json").write_text(
        json.dumps({"trainguard": {"telemetry": {"peak_flops": 1e10}}})
    )
    return run


def test_report_sections_markers_and_incidents(tmp_path: Path) -> None:
    run = _run(tmp_path)
    data = load_run(run)
    assert len(data.records[0]) == 12  # the torn last line is skipped
    html = render_report(data)
    assert "MFU (%)" in html and "peak FLOP/s</td><td>1e+10" in html
    assert html.count('class="tg-glyph tg-failure"') == 1
    assert 'class="tg-glyph tg-hang"' in html
    assert 'class="tg-glyph tg-restore"' in html
    assert 'class="tg-marker tg-restart"' in html
    assert "rank 1 is 3x slower" in html and "rank 1 frozen" in html  # health incidents
    assert "tg-attempt-failed" in html
    assert "<script" not in html
    # goodput: the hang (last step end 3.2 s → detection 4 s) is its own cause
    assert "<td>hang</td><td>0.80 s</td>" in html


def test_report_of_a_run_without_events_or_steps(tmp_path: Path) -> None:
    run = tmp_path / "empty"
    (run / "metrics").mkdir(parents=True)
    path = write_report(run)
    html = path.read_text()
    assert "no data" in html and "none recorded" in html


def test_report_cli_rejects_a_non_run_dir(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", str(tmp_path)],
        capture_output=True, text=True, env=base_env(), cwd=REPO, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "pass a run directory" in r.stderr


def _is_nice(step: float) -> bool:
    """True when ``step`` is 1, 2 or 5 times a power of ten."""
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
    return any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5))


@pytest.mark.parametrize(
    ("lo", "hi"),
    [(0, 50.8), (3.7, 8.13), (0.0012, 0.0047), (1.0e6, 3.3e6), (-7.3, 12.9), (99.2, 100.9),
     (0, 1), (17, 17.4)],
)  # fmt: skip
def test_chart_ticks_sit_on_round_numbers(lo: float, hi: float) -> None:
    ticks = svg.nice_ticks(lo, hi, 4)
    assert 3 <= len(ticks) <= 8, ticks
    assert all(lo - 1e-12 <= t <= hi + 1e-12 for t in ticks), ticks
    step = ticks[1] - ticks[0]
    assert _is_nice(step), (step, ticks)
    assert all(abs(b - a - step) < step * 1e-6 for a, b in itertools.pairwise(ticks)), ticks
    assert all(abs(t / step - round(t / step)) < 1e-6 for t in ticks), ticks


def test_line_chart_axis_labels_are_round() -> None:
    chart = svg.line_chart(
        {"loss": [(3.0 + 0.37 * i, 3.7 + 4.43 * (i % 3) / 2) for i in range(20)]},
        title="loss", xlabel="step",
    )  # fmt: skip
    for cls in ("tg-ytick", "tg-xtick"):
        labels = re.findall(rf'class="{cls}">([^<]+)<', chart)
        values = [float(v) for v in labels]
        assert len(values) >= 3, chart
        step = values[1] - values[0]
        assert _is_nice(step), (cls, labels)
        assert all(abs(v / step - round(v / step)) < 1e-6 for v in values), (cls, labels)
    ys = [float(v) for v in re.findall(r'class="tg-ytick">([^<]+)<', chart)]
    assert ys[0] <= 3.7 and ys[-1] >= 8.13, ys  # the y axis ends on ticks around the data


def test_engine_fleet_section_draws_the_rollout_figures_and_failures(tmp_path: Path) -> None:
    events = [
        {"time": T0, "kind": "launch", "node": "n", "attempt": 0},
        {"time": T0 + 0.5, "kind": "role_replica_state", "node": "n", "role": "rollout",
         "replica": 0, "state": "serving", "weight_version": 0},
        {"time": T0 + 1.2, "kind": "workers_started", "node": "n", "attempt": 0},
        {"time": T0 + 2.1, "kind": "rollout_failed", "node": "n", "rank": 0, "reason": "refused",
         "engine": "http://127.0.0.1:8101"},
        {"time": T0 + 2.2, "kind": "rollout_failed", "node": "n", "rank": 1, "reason": "refused",
         "engine": "http://127.0.0.1:8101"},
        {"time": T0 + 2.3, "kind": "rollout_failed", "node": "n", "rank": 1, "reason": "timeout",
         "engine": "http://127.0.0.1:8102", "retried": False},
        {"time": T0 + 3, "kind": "rollout_refit_verified", "engine": "http://127.0.0.1:8101",
         "version": 1},
        {"time": T0 + 3, "kind": "rollout_engine_quarantined", "version": 2,
         "engine": "http://127.0.0.1:8102", "reason": "log-probs differ by 0.1 > 0.001"},
        {"time": T0 + 3, "kind": "rollout_refit_verified", "engine": "http://127.0.0.1:8102",
         "version": 2},
        {"time": T0 + 4, "kind": "job_finished", "node": "n", "attempt": 0, "state": "succeeded"},
    ]  # fmt: skip
    records: dict[int, list[dict]] = {0: [], 1: []}
    for rank in (0, 1):
        for i in range(4):
            records[rank].append({"time": T0 + 2 + 0.4 * i, "kind": "step", "rank": rank,
                                  "attempt": 0, "step": i, "step_time_s": 0.3})  # fmt: skip
            rec = {
                "kind": "log",
                "rank": rank,
                "step": i,
                "reward": 0.1 * i,
                "reward_std": 0.2,
                "response_length": 5 + i,
                "rollout_tokens_per_s": 100.0 + i,
                "rollout_latency_p50_s": 0.1,
                "rollout_latency_p99_s": 0.3,
                "engines_serving": 2 - (i == 1),
                "engines_total": 2,
                "weight_sync_s": 0.02,
                "weight_sync_timeout_s": 3.0,
                "staleness_max": 0,
                "staleness_mean": 0.0,
                "rollout_retries": int(i == 1),
                "rollout_failed_refused": int(i == 1),
            }
            records[rank].append(rec)
    run = tmp_path / "run"
    _write(run, events, records)
    html = render_report(load_run(run))
    fleet = html.split('<div id="fleet">', 1)[1].split("<h2>", 1)[0]
    rollout = fleet.split('<div class="charts" id="rollout">', 1)[1].split("</div>", 1)[0]
    titles = re.findall(r"<title>([^<]+)</title>", rollout)
    for t in ("Rollout tokens/s", "Rollout latency p50 / p99 (s)", "Engines routable / total",
              "Weight sync (s)", "Staleness (versions)",
              "Rollout requests failed (by reason) and retried"):  # fmt: skip
        assert t in titles, titles
    assert "routable rank 1" in rollout and "total rank 0" in rollout
    assert "failed: refused" in rollout and "retried" in rollout
    table = fleet.split('<table class="tg-rollout-failures">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(
        r"<tr><td>([^<]+)</td><td>([^<]+)</td><td>(\d+)</td><td>(\d+)</td></tr>", table
    )
    assert rows == [("refused", "http://127.0.0.1:8101", "2", "2"),
                    ("timeout", "http://127.0.0.1:8102", "1", "0")]  # fmt: skip
    checks = fleet.split('<table class="tg-refit-checks">', 1)[1].split("</table>", 1)[0]
    assert re.findall(
        r"<tr><td>([^<]+)</td><td>(\d+)</td><td>(\d+)</td><td>([^<]*)</td>", checks
    ) == [
        ("http://127.0.0.1:8101", "1", "0", ""),
        ("http://127.0.0.1:8102", "1", "1", "version 2: log-probs differ by 0.1 &gt; 0.001"),
    ]
    training = html.split('<div class="charts" id="training">', 1)[1].split("</div>", 1)[0]
    assert "Reward std" in training and "Response length" in training


def test_report_of_a_run_without_a_fleet_has_no_rollout_charts(tmp_path: Path) -> None:
    html = render_report(load_run(_run(tmp_path)))
    fleet = html.split('<div id="fleet">', 1)[1].split("<h2>", 1)[0]
    assert "No engine fleet" in fleet and "<svg" not in fleet
    assert "tg-rollout-failures" not in fleet and "tg-refit-checks" not in fleet


def test_summary_of_a_job_that_failed_without_a_worker_failure(tmp_path: Path) -> None:
    """A job can end failed with no worker failing (a role that cannot be kept running, a
    node taken out): the summary's first line must not read as a clean run."""
    from trainguard.telemetry.summary import recovery_summary

    def head(state: str) -> str:
        evs = [{"time": 100.0, "kind": "launch", "node": "n", "attempt": 0},
               {"time": 105.0, "kind": "job_finished", "node": "n", "attempt": 0,
                "state": state, "restarts": 0}]  # fmt: skip
        (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
        return recovery_summary(tmp_path)[0]

    assert head("failed").startswith("trainguard run: no worker failures; job failed")
    assert head("do_not_requeue").startswith("trainguard run: no worker failures; job stopped")
    assert head("succeeded").startswith("trainguard run: no failures")
