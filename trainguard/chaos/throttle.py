"""Throttle a running process to about half speed (or another share), for real: a rank whose
device or host has become slow, as the straggler and sniff-test detectors must find it.

- where this process may signal it (the same user, or root): a duty cycle of ``SIGSTOP`` and
  ``SIGCONT`` from a thread here, over a 4 ms period (1 ms running of every 4 at a quarter).
  Every burst of work is slowed, a sniff GEMM of a few milliseconds included, on any kernel:
  a cgroup's CPU quota is only charged at the scheduler's tick (4 ms at ``CONFIG_HZ=250``), so a
  mostly idle process whose bursts are shorter than that never reaches its quota, and a woken
  process preempts the spinners of the affinity method below. Continued at the end;
- otherwise a writable cgroup (v2 ``cpu.max`` / ``cpu.weight``, else v1 ``cpu.cfs_quota_us`` /
  ``cpu.shares``): the process moves into a new child cgroup with the share of a core's quota
  over a short period (1 ms of every 2 ms at a half) *and* the share of the default weight (on
  a loaded machine, with more runnable processes than cores, the quota never binds: the process
  gets less than that anyway, and the weight cuts its share). Moved back and removed at the end;
- otherwise: every thread of the process is pinned (``sched_setaffinity``) onto one core and a
  spinning process started here onto the same core (the scheduler shares it between the two:
  half each, on an otherwise idle core; a smaller share, more spinners). The spinner is ended by its PID at the end; the
  affinity is restored.

    with throttle(pid) as how:   # "signals", "cgroup" or "taskset"
        ...
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = ["throttle"]

CGROUP = Path("/sys/fs/cgroup")
PERIOD_S = 0.004
"""The duty cycle's period: shorter than a sniff GEMM, longer than a signal's round trip."""


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


def _may_signal(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _duty_cycle(pid: int, share: float, done: threading.Event) -> None:
    """Stop ``pid`` for ``1 - share`` of every period until ``done`` (then continue it)."""
    run_s, stop_s = PERIOD_S * share, PERIOD_S * (1 - share)
    # on time even on a busy machine where allowed (CAP_SYS_NICE): a late wake-up that ends a
    # stop late only slows it more, one that ends a run late lets a whole burst through
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_FIFO, os.sched_param(1))
    try:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(run_s)
    except ProcessLookupError:  # it ended
        return
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def throttle(pid: int, share: float = 0.5) -> Iterator[str]:
    """About ``share`` of its speed (half by default) for ``pid`` while the block runs; yields
    how (``signals``, ``cgroup`` or ``taskset``)."""
    if not 0 < share < 1:
        raise ValueError(f"throttle share must be between 0 and 1, not {share}")
    if _may_signal(pid):
        done = threading.Event()
        t = threading.Thread(
            target=_duty_cycle, args=(pid, share, done), name="trainguard-throttle", daemon=True
        )
        t.start()
        try:
            yield "signals"
        finally:
            done.set()
            t.join()
        return
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
