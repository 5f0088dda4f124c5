"""Files trainguard writes where another principal may have placed something first: never
through a symlink, never into a request directory that is a symlink or not the job user's.

Real processes: ``trainguard report`` on a run directory with symlinks planted at the report's
names; a real ``trainguard run`` whose workers answer dump requests, with request directories
planted as a symlink (and, as root, one owned by another user) and symlinks planted at the
dump's names; ``trainguard debug`` on a run directory whose ``debug`` is a symlink."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.health_fixtures.jobs import job_env
from tests.launch_utils import base_env
from tests.procs import kill_tree
from trainguard.core.atomicfile import atomic_open, make_dirs, open_append, write_atomic

pytestmark = pytest.mark.xdist_group("hang")

SCRIPT = Path(__file__).resolve().parent / "workers" / "plain_collectives.py"
SECRET_LINE = "ssh-ed25519 AAAA-planted attacker@host"


def _victim(tmp_path: Path, name: str) -> Path:
    p = tmp_path / "home" / name
    p.parent.mkdir(exist_ok=True)
    p.write_text("the user's own file\n")
    return p


def test_the_helpers_never_follow_a_planted_symlink(tmp_path: Path) -> None:
    victim = _victim(tmp_path, "authorized_keys")
    target = tmp_path / "out.json"
    target.symlink_to(victim)
    write_atomic(target, "{}")
    assert victim.read_text() == "the user's own file\n"
    assert not target.is_symlink() and target.read_text() == "{}"
    with atomic_open(tmp_path / "x.txt") as f:
        f.write("a")
    assert [p.name for p in tmp_path.glob(".x.txt*")] == []  # no temporary left
    log = tmp_path / "events.jsonl"
    log.symlink_to(victim)
    with pytest.raises(OSError):
        os.close(open_append(log))
    assert victim.read_text() == "the user's own file\n"
    d = make_dirs(tmp_path / "a" / "b", 0o700)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE(d.parent.stat().st_mode) == 0o700


def test_report_of_another_users_run_dir_never_writes_through_its_symlinks(tmp_path: Path) -> None:
    """The run directory's owner plants symlinks at the report's names, pointing at files of
    whoever makes the report; a hang's stack (newlines kept) carries the line to inject."""
    run = tmp_path / "run"
    run.mkdir()
    stack = f"Thread 0x1 (most recent call first):\n{SECRET_LINE}\n  File x.py, line 1\n"
    events = [
        {"kind": "launch", "time": time.time() - 10, "node": "n0", "world_size": 1},
        {"kind": "hang_detected", "time": time.time() - 5, "node": "n0", "rank": 0,
         "stack": stack},
        {"kind": "run_end", "time": time.time(), "node": "n0", "state": "SUCCEEDED"},
    ]  # fmt: skip
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    planted = {
        "report.html.tmp": _victim(tmp_path, "authorized_keys"),
        "report.html": _victim(tmp_path, "bashrc"),
    }
    for name, victim in planted.items():
        (run / name).symlink_to(victim)
    p = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", "-q", str(run)],
        capture_output=True, text=True, timeout=120, env=base_env(), stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    for victim in planted.values():
        assert victim.read_text() == "the user's own file\n", victim
    report = run / "report.html"
    assert not report.is_symlink() and "<html" in report.read_text()


def _collective_seq(run_dir: Path) -> int:
    from trainguard.core.flight_recorder import collective_progress_path
    from trainguard.core.progress import ProgressReader

    path = collective_progress_path(run_dir / "progress" / "attempt_0", 0)
    snap = ProgressReader(path.parent).read_path(path)
    return snap.step if snap else -1


def test_workers_answer_only_request_dirs_of_their_own_user(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "1",
        "--max-restarts", "0", "--monitor-interval", "0.1", "--tg-run-dir", str(run),
        str(SCRIPT), "--steps", "100000", "--step-s", "0.05",
    ]  # fmt: skip
    job = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(), stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = _victim(tmp_path, "authorized_keys")
    try:
        deadline = time.monotonic() + 180  # start-up on a loaded host
        while _collective_seq(run) < 5:
            assert time.monotonic() < deadline and job.poll() is None, "job did not start"
            time.sleep(0.2)
        assert stat.S_IMODE(run.stat().st_mode) == 0o700  # private by default
        debug = run / "debug"
        debug.mkdir(exist_ok=True)
        # a request directory that is a symlink (the dumps would land outside the run dir)
        (outside / "request").write_text("{}")
        (debug / "evil").symlink_to(outside, target_is_directory=True)
        # a real request directory with symlinks planted at the dump's (old, fixed) names
        ok = debug / "ok"
        ok.mkdir()
        (ok / "stacks_rank_0.txt.tmp").symlink_to(victim)
        (ok / "fr_rank_0.json.tmp").symlink_to(victim)
        (ok / "stacks_rank_0.txt").symlink_to(victim)
        others = None
        if os.geteuid() == 0:  # a directory of another user (only root can make one)
            others = debug / "others"
            others.mkdir()
            (others / "request").write_text("{}")
            os.chown(others, 65534, 65534)
        (ok / "request").write_text("{}")
        deadline = time.monotonic() + 60
        while not (ok / "fr_rank_0.json").exists():
            assert time.monotonic() < deadline and job.poll() is None, "no answer to the request"
            time.sleep(0.1)
        time.sleep(1.5)  # three more request polls: the planted ones had their chance
        assert job.poll() is None
        # trainguard debug refuses a debug directory that is a symlink
        run2 = tmp_path / "run2"
        run2.mkdir()
        (run2 / "debug").symlink_to(outside, target_is_directory=True)
        p = subprocess.run(
            [sys.executable, "-c",
             "from trainguard.cli.cmd_debug import collect; from pathlib import Path; import sys\n"
             f"try:\n  collect(Path({str(run2)!r}), [0], 1.0)\nexcept OSError as e:\n"
             "  print('refused', e); sys.exit(3)\n"],
            capture_output=True, text=True, timeout=60, env=base_env(),
        )  # fmt: skip
        assert p.returncode == 3 and "symlink" in p.stdout, (p.stdout, p.stderr)
    finally:
        kill_tree(job)
    assert sorted(x.name for x in outside.iterdir()) == ["request"], "a dump left the run dir"
    if others is not None:
        assert sorted(x.name for x in others.iterdir()) == ["request"]
    assert victim.read_text() == "the user's own file\n"
    assert (ok / "stacks_rank_0.txt").is_file() and not (ok / "stacks_rank_0.txt").is_symlink()
    assert "plain_collectives.py" in (ok / "stacks_rank_0.txt").read_text()


def test_group_access_is_a_setting_the_run_and_checkpoint_dirs_follow(tmp_path: Path) -> None:
    """``[runtime] dir_mode = "0750"``: the launcher creates the run directory with it and a
    worker creates its local checkpoint directory with it (read from the agent's config)."""
    script = tmp_path / "job.py"
    script.write_text(
        "import os\nfrom pathlib import Path\n"
        "from trainguard.checkpoint.manager import _make_private\n"
        "run = Path(os.environ['TRAINGUARD_AGENT_RUN_DIR'])\n"
        "_make_private(str(run / 'ckpt' / 'local'), run)\n"
    )
    run = tmp_path / "runs" / "r"
    env = {**base_env(), "TRAINGUARD_RUNTIME_DIR_MODE": "0750"}
    p = subprocess.run(
        [sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "1",
         "--max-restarts", "0", "--tg-run-dir", str(run), str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    for d in (run.parent, run, run / "ckpt", run / "ckpt" / "local"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o750, d
