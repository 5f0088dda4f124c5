"""torchft mode: real replica groups on gloo, real kill -9s.

Two ``trainguard run --ft`` replica groups of examples/ft_ddp.py; group 1's worker is
SIGKILLed twice (bench/ft.py does 30, beside torchft alone). The survivor must keep its PID
(no crash, no restart), report each pause, keep trainguard's metrics and disk checkpoints, and
end with the same weights as the rejoined group. torchft 0.2's own DDP hook crashes the
survivor on such kills (``assert fut._fut``); the guard must have caught at least one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.launch_utils import LAUNCHERS, REPO, base_env, free_port
from trainguard.core.config.ft import FTConfig
from trainguard.ft.lighthouse import FTUnavailable, ensure_lighthouse, reachable
from trainguard.testing.ft import run_kills

pytestmark = pytest.mark.ft


def _events(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind]


@pytest.mark.timeout(600)
def test_kills_of_one_replica_group_leave_the_survivor_running(tmp_path: Path) -> None:
    kills = 2  # two kill/rejoin cycles show what three did: each heals from the survivor
    res = run_kills("trainguard", tmp_path, kills=kills, timeout_s=120, env=base_env())

    assert res.survivor_crashes == 0, (tmp_path / "rg0.out").read_text()[-3000:]
    assert len(res.survivor_pids) == 1  # the survivor's worker was never restarted
    assert res.survivor_rc == 0 and res.victim_rc == 0
    assert len(res.pauses_s) == kills and all(p > 0 for p in res.pauses_s)
    assert res.final[0]["step"] == res.final[1]["step"]
    assert res.final[0]["pid"] == res.survivor_pids[0]
    assert res.weights_equal  # the rejoined group healed from the survivor and stayed in step

    survivor = res.run_dirs[0]
    lost = [e for e in _events(survivor, "ft_recovered") if "participants_lost" in e["reasons"]]
    assert len(lost) >= kills
    assert all(e["pause_s"] > 0 and e["participants"] == 1 for e in lost)
    assert max(e["guarded_failures"] for e in lost) >= 1  # torchft's hook would have crashed
    metrics = (survivor / "metrics" / "rank_0.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in metrics]
    assert sum(r["kind"] == "step" for r in records) >= res.final[0]["step"] // 2
    assert any("ft_pause_s" in r for r in records)
    assert _events(survivor, "checkpoint_committed")
    healed = _events(res.run_dirs[1], "ft_healed")
    assert len(healed) >= kills  # each restarted victim healed from the survivor

    starts = [e for d in res.run_dirs.values() for e in _events(d, "ft_lighthouse")]
    assert len(starts) == 2 and sum(e["started"] for e in starts) == 1  # one started, one found
    port = int(starts[0]["url"].rsplit(":", 1)[1])
    assert not reachable("127.0.0.1", port)  # the launcher that started it stopped it


def test_lighthouse_is_found_not_started_twice(tmp_path: Path) -> None:
    cfg = FTConfig(enabled=True, lighthouse_port=free_port())
    first = ensure_lighthouse(cfg, tmp_path)
    try:
        assert first.pid is not None and reachable("127.0.0.1", cfg.lighthouse_port)
        second = ensure_lighthouse(cfg, tmp_path)
        assert second.pid is None and second.url == first.url
        second.stop()  # not its own: a no-op
        assert reachable("127.0.0.1", cfg.lighthouse_port)
    finally:
        first.stop()
    assert not reachable("127.0.0.1", cfg.lighthouse_port)
    with pytest.raises(FTUnavailable, match="is not a URL"):
        ensure_lighthouse(FTConfig(lighthouse="127.0.0.1:29510"), tmp_path)


# torch's error handler enables faulthandler on stderr, which pytest's capture has no fd for
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_bad_lighthouse_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process, through the entry point the command runs (the real launch of this
    error family, a `trainguard run --ft` that stops in one line: the next test)."""
    from trainguard.cli.main import main

    monkeypatch.chdir(tmp_path)
    for k in list(os.environ):
        if k.startswith(("PET_", "TORCHELASTIC_", "TRAINGUARD_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("TRAINGUARD_FT_LIGHTHOUSE", "lighthouse:29510")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--ft", "--standalone", "--nproc-per-node", "1", "--tg-run-dir",
              str(tmp_path / "run"), str(REPO / "examples" / "ft_ddp.py")])  # fmt: skip
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "[ft] lighthouse" in lines[0] and "http://HOST:PORT" in lines[0]
    assert "Traceback" not in err


def test_without_torchft_ft_is_one_line(tmp_path: Path) -> None:
    # a torchft that fails to import (as on a host without it) shadows the installed one
    fake = tmp_path / "shadow" / "torchft"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no torchft on this host')\n")
    env = base_env()
    env["PYTHONPATH"] = f"{fake.parent}:{env['PYTHONPATH']}"
    p = subprocess.run(
        [*LAUNCHERS["trainguard"], "--ft", "--standalone", "--nproc-per-node", "1"]
        + ["--tg-run-dir", str(tmp_path / "run"), str(REPO / "examples" / "ft_ddp.py")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "no torchft on this host" in lines[0], p.stderr
    assert "pip install torchft==0.2.0" in lines[0]
