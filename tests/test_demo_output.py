"""What `make demo` shows a person: no Python traceback when a worker is killed and the job
recovers, one line per expected failure, and a recovery summary at the end of `trainguard run`
(the report counts the root cause, not the ranks the restart's teardown stopped); the kill is
attributed as transient and restarted once."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.launch_utils import REPO, base_env, launch


def test_demo_run_prints_no_traceback_and_ends_with_the_recovery_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    r = launch(
        "trainguard",
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--tg-run-dir",
         str(run_dir), str(REPO / "examples" / "train_mlp.py"), "--steps", "60",
         "--fail-at-step", "30", "--fail-rank", "1"],
        cwd=tmp_path,
        env=base_env(),
        timeout=240,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    head = next(i for i, x in enumerate(lines) if x.startswith("trainguard run: "))
    assert lines[head].startswith("trainguard run: 1 failure recovered; goodput "), lines[head:]
    detail = lines[head + 1]
    assert re.search(r"rank 1 killed by SIGKILL after \d+ steps; next step done", detail), detail
    assert re.search(
        r"resumed from (memory|peer_memory|disk) at step \d+ \(\d+ steps? redone\)", detail
    )
    assert head + 2 == len(lines), lines[head:]  # the summary ends the output
    # a SIGKILL is a transient fault: one restart, the job finishes (the kill case of
    # test_recovery_verdicts' transient faults, on this job)
    evs = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    attrs = [e for e in evs if e["kind"] == "failure_attributed"]
    assert attrs and all(a["verdict"] != "stop" for a in attrs), attrs
    assert attrs[0]["cause"] in ("transient", "network"), attrs[0]
    assert len([e for e in evs if e["kind"] == "restart"]) == 1
    from trainguard.telemetry.report import write_report

    html = Path(write_report(run_dir)).read_text()
    assert "worker failures</td><td>1<" in html
