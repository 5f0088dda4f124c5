"""Throttle a running process to about half speed (or another share), for real: a rank whose
device or host has become slow, as the straggler and sniff-test detectors must find it.

- a writable cgroup (v2 ``cpu.max`` / ``cpu.weight``, else v1 ``cpu.cfs_quota_us`` /
  ``cpu.shares``): the process moves into a new child cgroup with half a core's quota over
  a short period (1 ms of every 2 ms, the kernel's smallest quota: a burst of a few milliseconds, a sniff GEMM, runs
  at half speed too; over Slurm's usual 100 ms period a mostly idle process never reaches its
  quota) *and* half the default weight (on a loaded machine, with more runnable processes than
  cores, the quota never binds: the process gets less than that anyway, and the weight halves
  its share). Moved back and removed at the end;
- otherwise: every thread of the process is pinned (``sched_setaffinity``) onto one core and a
  spinning process started here onto the same core (the scheduler shares it between the two:
  half each, on an otherwise idle core; a smaller share, more spinners). The spinner is ended by its PID at the end; the
  affinity is restored.

    with throttle(pid) as how:
        ...
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = ["throttle"]

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


def _make_group(pid: int, share: float) -> tuple[Path, Path] | None:
    """(new child group, the group to move back to), throttled to ``share`` of a core, or None
    where not writable."""
    v2 = (CGROUP / "cgroup.controllers").exists()
    home = _cgroup_of(pid, "" if v2 else "cpu")
    if home is None:
        return None
    child = home / f"tg-throttle-{uuid.uuid4().hex[:8]}"
    try:
        if v2 and "cpu" not in (home / "cgroup.subtree_control").read_text().split():
            return None
        child.mkdir()
        period = max(2000, math.ceil(1000 / share))  # the kernel's smallest quota: 1 ms
        quota = round(period * share)
        if v2:
            (child / "cpu.max").write_text(f"{quota} {period}")
            (child / "cpu.weight").write_text(str(max(1, round(100 * share))))
        else:
            (child / "cpu.cfs_period_us").write_text(str(period))
            (child / "cpu.cfs_quota_us").write_text(str(quota))
            (child / "cpu.shares").write_text(str(max(2, round(1024 * share))))
        return child, home
    except OSError:
        with contextlib.suppress(OSError):
            child.rmdir()
        return None


@contextlib.contextmanager
def throttle(pid: int, share: float = 0.5) -> Iterator[str]:
    """About ``share`` of its speed (half by default) for ``pid`` while the block runs; yields
    how (``cgroup`` or ``taskset``)."""
    made = _make_group(pid, share)
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
    spinners = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(max(1, round(1 / share) - 1))
    ]
    try:
        for spinner in spinners:
            _pin(spinner.pid, busy)
        _pin(pid, busy)
        yield "taskset"
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        _pin(pid, before)
