"""RunDir: every run-directory path is spelled in trainguard/core/contracts/rundir.py."""

from __future__ import annotations

import re
from pathlib import Path

from trainguard.core.contracts.rundir import RunDir

PACKAGE = Path(__file__).resolve().parents[1] / "trainguard"
# a run-dir path joined by hand: run_dir / "metrics", ... / "rank_*.jsonl", "config.json"
SPELLED = re.compile(
    r'/ "(metrics|checkpoints|config\.json|events\.jsonl|progress)"|"rank_\*\.jsonl"|"rank_\{[a-z_.]+\}\.jsonl"'
)


def test_paths() -> None:
    r = RunDir("/job")
    assert r.events == Path("/job/events.jsonl")
    assert r.config == Path("/job/config.json")
    assert r.metrics(3) == Path("/job/metrics/rank_3.jsonl")
    assert RunDir.metrics_rank(r.metrics(3)) == 3 and RunDir.metrics_rank(Path("x.jsonl")) is None
    assert r.checkpoints == Path("/job/checkpoints")
    assert r.progress(2) == Path("/job/progress/attempt_2")


def test_metrics_files_sorted(tmp_path: Path) -> None:
    r = RunDir(tmp_path)
    r.metrics_dir.mkdir()
    for rank in (1, 0):
        r.metrics(rank).write_text("")
    (r.metrics_dir / "other.txt").write_text("")
    assert r.metrics_files() == [r.metrics(0), r.metrics(1)]


def test_no_module_spells_a_run_dir_path() -> None:
    found = [
        f"{p.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.name != "rundir.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if SPELLED.search(line)
    ]
    assert not found, "use trainguard.core.contracts.rundir.RunDir:\n" + "\n".join(found)
