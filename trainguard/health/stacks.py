"""Python stack dumps of worker processes: py-spy when installed, else faulthandler via a signal.

Worker side, :func:`register_stack_dump` (called by ``trainguard.init()`` under the agent)
registers ``faulthandler`` on :data:`STACK_SIGNAL`, writing to a per-rank file in the run
directory. Agent side, :func:`dump_stacks` collects every rank's stack.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

from trainguard.core.atomicfile import make_dirs, open_append, write_atomic
from trainguard.core.contracts.rundir import RunDir

__all__ = ["STACK_SIGNAL", "dump_stacks", "faulthandler_path", "register_stack_dump"]

logger = logging.getLogger(__name__)

STACK_SIGNAL = signal.SIGUSR2


def faulthandler_path(run_dir: str | os.PathLike[str], attempt: int, rank: int) -> Path:
    return RunDir(run_dir).signal_stacks(attempt, rank)


def register_stack_dump(run_dir: str | os.PathLike[str], rank: int, attempt: int) -> IO[str] | None:
    """Dump all threads' stacks to the rank's file on :data:`STACK_SIGNAL`. Leaves a signal
    the program already handles alone. Returns the open file (keep it alive) or None."""
    try:
        if signal.getsignal(STACK_SIGNAL) not in (signal.SIG_DFL, None):
            return None
        path = faulthandler_path(run_dir, attempt, rank)
        make_dirs(path.parent)
        f = os.fdopen(open_append(path), "a", encoding="utf-8")
        faulthandler.register(STACK_SIGNAL, file=f, all_threads=True, chain=False)
        return f
    except (OSError, ValueError, RuntimeError) as e:
        logger.warning("could not register the stack dump signal: %s", e)
        return None


def _py_spy() -> str | None:
    exe = shutil.which("py-spy")
    if exe:
        return exe
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else None


def _py_spy_dump(exe: str, pid: int, timeout_s: float) -> str | None:
    try:
        p = subprocess.run(
            [exe, "dump", "--pid", str(pid), "--nonblocking"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (subprocess.TimeoutExpired, OSError) as e:
        logger.warning("py-spy dump of pid %d failed: %s", pid, e)
        return None
    if p.returncode != 0 or not p.stdout.strip():
        logger.warning("py-spy dump of pid %d failed: %s", pid, p.stderr.strip()[:500])
        return None
    return p.stdout


def _faulthandler_dump(path: Path, pid: int, timeout_s: float) -> str | None:
    before = path.stat().st_size if path.exists() else 0
    try:
        os.kill(pid, STACK_SIGNAL)
        os.kill(pid, signal.SIGCONT)  # a stopped process handles the signal once continued
    except OSError as e:
        logger.warning("cannot signal pid %d for a stack dump: %s", pid, e)
        return None
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        size = path.stat().st_size if path.exists() else 0
        if size > before and size == last:  # grown and settled
            with path.open("r", encoding="utf-8", errors="replace") as f:
                f.seek(before)
                return f.read()
        last = size
        time.sleep(0.1)
    return None


def dump_stacks(
    pids: dict[int, int],
    *,
    run_dir: str | os.PathLike[str],
    attempt: int,
    timeout_s: float = 10.0,
    use_py_spy: bool = True,
) -> dict[int, dict[str, str]]:
    """Stacks of ``pids`` (rank → pid), concurrently. Returns rank → {"method", "path",
    "stack"}; a rank whose stack could not be taken gets method "none"."""
    rd = RunDir(run_dir)
    make_dirs(rd.stacks(attempt))
    exe = _py_spy() if use_py_spy else None

    def one(rank: int, pid: int) -> tuple[int, dict[str, str]]:
        stack, method = None, "none"
        if exe:
            stack, method = _py_spy_dump(exe, pid, timeout_s), "py-spy"
        if stack is None:
            fh = faulthandler_path(run_dir, attempt, rank)
            stack, method = _faulthandler_dump(fh, pid, min(timeout_s, 3.0)), "faulthandler"
        if stack is None:
            stack, method = "(no stack: py-spy unavailable and no faulthandler response)", "none"
        path = rd.hung_stack(attempt, rank)
        try:
            write_atomic(path, f"# rank {rank} pid {pid} via {method}\n{stack}")
        except OSError as e:
            logger.warning("cannot write %s: %s", path, e)
        return rank, {"method": method, "path": str(path), "stack": stack}

    if not pids:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(pids))) as pool:
        return dict(pool.map(lambda kv: one(*kv), sorted(pids.items())))
