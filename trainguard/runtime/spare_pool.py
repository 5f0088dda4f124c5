"""Warm workers: the next attempt's worker processes, started before they are needed.

A replacement node (a spare that takes a dead node's slot) and the survivors of a failure
restart their workers, and on a busy host most of that restart is each new worker importing
torch. With ``[spares] warm_workers = true`` every agent keeps ``nproc_per_node`` processes
that have already imported ``[spares] warm_preload`` (:mod:`trainguard.runtime.warm_worker`) and
hands each the worker torch's agent would have started (same command line, environment, log
files, process session): a spare's pool fills while it waits, an active node's pool refills
once its workers have made their first step. A warm process that died, a command line that is
not ``python -u [-m] SCRIPT ...``, or NUMA binding: torch's own ``Popen``, as always.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.multiprocessing import api as mp_api
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from trainguard.core.config.spares import SparesConfig
from trainguard.core.plugin import AgentContext
from trainguard.runtime import _torch

__all__ = ["WarmPool", "install", "start"]

logger = logging.getLogger(__name__)


class WarmPool:
    """Up to ``size`` warm processes of this agent (started in their own sessions, as torch
    starts workers; killed by PID when the pool closes or the agent dies)."""

    def __init__(self, size: int, preload: list[str]) -> None:
        self.size = size
        self.preload = ",".join(preload)
        self._idle: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.handed_out = 0

    def fill(self, on_ready: Callable[[int, float], None] | None = None) -> None:
        """Start processes up to ``size``; ``on_ready(n, seconds)`` once the ``n`` new ones have
        all imported ``preload`` (from a thread)."""
        started: list[int] = []
        t0 = time.monotonic()
        with self._lock:
            if self._closed:
                return
            self._idle = [p for p in self._idle if p.poll() is None]
            while len(self._idle) < self.size:
                r, w = os.pipe()
                try:
                    proc = subprocess.Popen(
                        [
                            sys.executable,
                            "-u",
                            "-m",
                            "trainguard.runtime.warm_worker",
                            self.preload,
                            str(w),
                        ],  # fmt: skip
                        stdin=subprocess.PIPE,
                        start_new_session=True,
                        pass_fds=(w,),
                    )
                finally:
                    os.close(w)
                self._idle.append(proc)
                started.append(r)

        def wait_ready() -> None:
            n = 0
            for r in started:
                try:
                    n += len(os.read(r, 1))  # b"" when the process died first
                finally:
                    os.close(r)
            if on_ready is not None and n:
                on_ready(n, time.monotonic() - t0)

        if started:
            threading.Thread(target=wait_ready, name="tg-warm-ready", daemon=True).start()

    def take(self) -> subprocess.Popen[bytes] | None:
        with self._lock:
            while self._idle:
                p = self._idle.pop(0)
                if p.poll() is None:
                    self.handed_out += 1
                    return p
            return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for p in idle:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


class _WarmHandler(_torch.SubprocessHandlerBase):
    """torch's handler, with the process taken from the pool when it can be."""

    pool: WarmPool | None = None

    def popen(self, args: tuple, env: dict[str, str]) -> subprocess.Popen:
        pool = _WarmHandler.pool
        argv = list(args[1:])
        ok_cmd = args[0] == sys.executable and argv[:1] == ["-u"] and len(argv) > 1
        proc = pool.take() if pool is not None and ok_cmd else None
        if proc is None or proc.stdin is None:
            return super().popen(args, env)
        spec = {
            "argv": argv[1:],
            "env": env,
            "stdout": getattr(self.stdout_file, "name", None),
            "stderr": getattr(self.stderr_file, "name", None),
        }
        try:
            proc.stdin.write((json.dumps(spec) + "\n").encode())
            proc.stdin.close()
        except OSError as e:  # died between take() and now
            logger.debug("warm worker %s unusable: %s", proc.pid, e)
            return super().popen(args, env)
        return proc


def _get_subprocess_handler(
    entrypoint: str,
    args: tuple,
    env: dict[str, str],
    stdout: str,
    stderr: str,
    local_rank_id: int,
    numa_options: Any = None,
) -> SubprocessHandler:
    cls = SubprocessHandler if numa_options is not None else _WarmHandler
    return cls(
        entrypoint=entrypoint,
        args=args,
        env=env,
        stdout=stdout,
        stderr=stderr,
        local_rank_id=local_rank_id,
        numa_options=numa_options,
    )


def install(pool: WarmPool) -> Callable[[], None]:
    """Start this agent's workers from ``pool``; returns the function that undoes it."""
    original = mp_api.get_subprocess_handler
    _WarmHandler.pool = pool
    mp_api.get_subprocess_handler = _get_subprocess_handler  # type: ignore[assignment]

    def uninstall() -> None:
        mp_api.get_subprocess_handler = original
        _WarmHandler.pool = None
        pool.close()

    return uninstall


def start(
    cfg: SparesConfig,
    nproc: int,
    entrypoint: object,
    ctx: AgentContext,
    has_spares: Callable[[], bool] | None = None,
) -> Callable[[], None] | None:
    """The agent's warm pool per ``cfg`` (``[spares] warm_workers``). ``on``: filled now (the
    first attempt's workers start from it) and again once each attempt's workers made a step.
    ``auto``: filled when this node waits as a spare, or once a step is made and
    ``has_spares()`` says the job has spares. Returns the function that removes it (kills the
    idle processes); None when off, or for a function entrypoint (``entrypoint`` not a str)."""
    mode = cfg.warm_workers
    if mode == "off" or not isinstance(entrypoint, str) or nproc < 1:
        return None
    if mode == "auto" and has_spares is None:
        return None
    pool = WarmPool(nproc, list(cfg.warm_preload))
    uninstall = install(pool)

    def ready(n: int, seconds: float) -> None:
        ctx.events.emit(
            "warm_workers_ready", count=n, duration_s=round(seconds, 2), agent_pid=os.getpid()
        )

    unsubscribes = []
    if mode == "on":
        pool.fill(ready)
    else:  # a spare warms up while it waits

        def spare_fill(_event: dict[str, Any]) -> None:
            logger.info("warm workers: this node waits as a spare, filling its pool")
            pool.fill(ready)

        unsubscribes.append(ctx.events.subscribe(spare_fill, ["spare_waiting"]))

    used = [0]
    generation = [0]

    def refill_after_first_step(_event: dict[str, Any]) -> None:
        ctx.events.emit(
            "warm_workers",
            used=pool.handed_out - used[0],
            pool_size=pool.size,
            agent_pid=os.getpid(),
        )
        used[0] = pool.handed_out
        generation[0] += 1
        mine = generation[0]

        def wait_then_fill() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not pool._closed:
                if any(s.num_steps > 0 for s in ctx.worker_progress().values()):
                    break
                time.sleep(0.5)
            while mode == "auto" and not pool._closed and generation[0] == mine:
                try:
                    if has_spares is not None and has_spares():
                        break
                except Exception as e:  # the store may be briefly unreachable
                    logger.debug("warm workers: cannot tell whether the job has spares: %s", e)
                time.sleep(2.0)
            if generation[0] == mine:
                pool.fill(ready)

        threading.Thread(target=wait_then_fill, name="tg-warm-refill", daemon=True).start()

    unsubscribes.append(ctx.events.subscribe(refill_after_first_step, ["workers_started"]))

    def stop() -> None:
        for unsubscribe in unsubscribes:
            unsubscribe()
        uninstall()

    return stop
