"""The orphan sweep removes the tiers of dead agents and never a live one, even one whose PID
means nothing here (an agent in another PID namespace sharing /dev/shm). Real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainguard.checkpoint.memtier.sweep import LEGACY_IDLE_S, OWNER_LOCK, remove_orphans

OWNER = """
import sys, time
from pathlib import Path
from trainguard.checkpoint.memtier.sweep import hold_owner_lock
fd = hold_owner_lock(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid  # gone here, as any PID of another namespace may be


def _owner(tier: Path) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tier)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def _tier(root: Path, pid: int, tag: str) -> Path:
    d = root / f"trainguard-ckpt-{pid}-{tag}"
    (d / "local" / "rank_0").mkdir(parents=True)
    (d / "local" / "rank_0" / "slot0.bin").write_bytes(b"x" * 64)
    return d


def test_live_tier_with_a_foreign_pid_is_kept_dead_one_is_removed(tmp_path: Path) -> None:
    live = _tier(tmp_path, _dead_pid(), "live")  # its agent's PID is not alive *here*
    dead = _tier(tmp_path, _dead_pid(), "dead")
    owners = [_owner(live), _owner(dead)]
    try:
        assert remove_orphans(tmp_path) == []  # both owners alive: nothing goes
        owners[1].kill()  # the second agent dies (kill -9): the kernel drops its lock
        owners[1].wait()
        assert remove_orphans(tmp_path) == [dead.name]
        assert live.is_dir() and (live / "local" / "rank_0" / "slot0.bin").exists()
        assert not dead.exists()
        assert remove_orphans(tmp_path) == []  # the probe did not keep the live one's lock
        assert owners[0].poll() is None
    finally:
        for p in owners:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()


def test_tier_without_owner_lock_is_removed_only_when_long_idle(tmp_path: Path) -> None:
    fresh = _tier(tmp_path, _dead_pid(), "fresh")  # e.g. an agent this instant after mkdtemp
    old = _tier(tmp_path, _dead_pid(), "old")
    mine = _tier(tmp_path, os.getpid(), "mine")
    past = time.time() - LEGACY_IDLE_S - 60
    for p in [old, *old.rglob("*")]:
        os.utime(p, (past, past))
    assert remove_orphans(tmp_path) == [old.name]
    assert fresh.is_dir() and mine.is_dir()
    assert not (fresh / OWNER_LOCK).exists()
