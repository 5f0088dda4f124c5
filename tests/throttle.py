"""Throttle a running process to about half speed, for real.

- a writable cgroup (v2 ``cpu.max`` / ``cpu.weight``, else v1 ``cpu.cfs_quota_us`` /
  ``cpu.shares``): the process moves into a new child cgroup with half a core's quota over
  a short period (1 ms of every 2 ms, the kernel's smallest quota: a burst of a few milliseconds, a sniff GEMM, runs
  at half speed too; over Slurm's usual 100 ms period a mostly idle process never reaches its
  quota) *and* half the default weight (on a loaded machine, with more runnable processes than
  cores, the quota never binds: the process gets less than that anyway, and the weight halves
  its share). Moved back and removed at the end;
- otherwise: every thread of the process is pinned (``sched_setaffinity``) onto one core and a
  spinning process started here onto the same core (the scheduler shares it between the two:
  half each, on an otherwise idle core). The spinner is ended by its PID at the end; the
  affinity is restored.

    with throttle(pid) as how:
        ...
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _pin(pid: int, cpus: set[int]) -> None:
    for tid in _threads(pid):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cpus)


def _cgroup_of(pid: int, controller: str) -> Path | None:
    """The cgroup directory ``pid`` is in for ``controller`` (v2: the unified one)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, rel = line.split(":", 2)
        if controller == "" and names == "":
            return CGROUP / rel.lstrip("/")
        if controller and controller in names.split(","):
            return CGROUP / controller / rel.lstrip("/")
    return None


def _make_group(pid: int) -> tuple[Path, Path] | None:
    """(new child group, the group to move back to), throttled, or None where not writable."""
    v2 = (CGROUP / "cgroup.controllers").exists()
    home = _cgroup_of(pid, "" if v2 else "cpu")
    if home is None:
        return None
    child = home / f"tg-throttle-{uuid.uuid4().hex[:8]}"
    try:
        if v2 and "cpu" not in (home / "cgroup.subtree_control").read_text().split():
            return None
        child.mkdir()
        if v2:
            (child / "cpu.max").write_text("1000 2000")
            (child / "cpu.weight").write_text("50")
        else:
            (child / "cpu.cfs_period_us").write_text("2000")
            (child / "cpu.cfs_quota_us").write_text("1000")
            (child / "cpu.shares").write_text("512")
        return child, home
    except OSError:
        with contextlib.suppress(OSError):
            child.rmdir()
        return None


@contextlib.contextmanager
def throttle(pid: int) -> Iterator[str]:
    """About half speed for ``pid`` while the block runs; yields how (``cgroup`` or
    ``taskset``)."""
    made = _make_group(pid)
    if made is not None:
        group, home = made
        try:
            (group / "cgroup.procs").write_text(str(pid))  # every thread, later ones too
            yield "cgroup"
        finally:
            with contextlib.suppress(OSError):
                (home / "cgroup.procs").write_text(str(pid))
            with contextlib.suppress(OSError):
                group.rmdir()
        return
    cpus = sorted(os.sched_getaffinity(0))
    busy = {cpus[-1]}
    before = os.sched_getaffinity(pid)
    spinner = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _pin(spinner.pid, busy)
        _pin(pid, busy)
        yield "taskset"
    finally:
        spinner.kill()
        spinner.wait()
        _pin(pid, before)
