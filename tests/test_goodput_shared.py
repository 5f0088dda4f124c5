"""Goodput is counted once: the planner's run reader (plan/fromrun.py) and the telemetry
(core/goodput.py) agree on productive time, loss rollbacks and hangs included."""

from __future__ import annotations

import json
from pathlib import Path

from trainguard.core.events import read_events
from trainguard.core.goodput import compute_goodput
from trainguard.plan.fromrun import read_run


def _write_run(run: Path) -> list[dict]:
    t = 1000.0
    events = [{"time": t, "kind": "launch", "node": "n", "attempt": 0, "process_start": t}]
    recs: list[dict] = []
    for n in range(10):  # steps 0-9, one second each
        t += 1.0
        recs.append(
            {"time": t, "kind": "step", "step": n, "step_time_s": 1.0, "rank": 0, "attempt": 0}
        )
    # a loss rollback to step 5: steps 5-9 are discarded
    t += 0.5
    recs.append(
        {
            "time": t,
            "kind": "log",
            "step": 9,
            "rank": 0,
            "attempt": 0,
            "rollback_to": 5,
            "rollback_s": 0.5,
        }
    )
    for n in range(5, 8):  # redone 5-7, then a hang
        t += 1.0
        recs.append(
            {"time": t, "kind": "step", "step": n, "step_time_s": 1.0, "rank": 0, "attempt": 0}
        )
    t += 5.0
    events.append({"time": t, "kind": "hang_detected", "node": "n", "attempt": 0, "ranks": [0]})
    t += 1.0
    events.append({"time": t, "kind": "job_finished", "node": "n", "attempt": 0, "state": "failed"})
    (run / "metrics").mkdir(parents=True)
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "metrics" / "rank_0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def test_planner_and_telemetry_count_the_same_productive_time(tmp_path: Path) -> None:
    recs = _write_run(tmp_path)
    g = compute_goodput(list(read_events(tmp_path)), recs)
    costs = read_run(tmp_path)
    # 0-4 kept, 5-9 discarded by the rollback, 5-7 redone: 8 s, not the 10 s of first-time steps
    assert g.productive_s == 8.0
    assert costs.productive_s == g.productive_s
    assert costs.measured_ettr == g.ettr
    assert g.lost_s["hang"] > 0 and costs.failures == 1
