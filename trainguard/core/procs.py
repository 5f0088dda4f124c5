"""Ending processes: a node's workers by PID, and this process without the interpreter's
teardown; the cyclic garbage collector held off while a process imports torch (an agent, a
pre-started worker) or while a worker sets up (:func:`hold_gc_in_worker`)."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
import threading
from typing import NoReturn

from trainguard.core.contracts import envvars

__all__ = [
    "exit_now",
    "hold_gc_in_worker",
    "kill_ranks",
    "pause_gc",
    "release_worker_gc",
    "resume_gc",
]

logger = logging.getLogger(__name__)

_gc_paused = False
_gc_held = False
_gc_hold_lock = threading.Lock()


def pause_gc() -> None:
    """Hold off the cyclic garbage collector while this process imports torch and sets up.
    The import allocates a few hundred thousand objects that live as long as the process, and
    the collector, triggered by their number, walks them all in full collections (three or four
    in an agent's start-up, 0.2-0.3 s of CPU on the critical path). :func:`resume_gc` turns it
    back on. Does nothing where the collector is already off."""
    global _gc_paused
    if gc.isenabled():
        gc.disable()
        _gc_paused = True


def resume_gc(*, freeze: bool = True) -> None:
    """After :func:`pause_gc`: move every object allocated so far to the collector's permanent
    generation (``gc.freeze``: module state, never garbage) and turn the collector back on, so
    that its later full collections walk only what the process allocates from now on. Without
    ``freeze`` (a process whose set-up objects may be dropped later: a model replaced) the
    collector is only turned back on. Does nothing unless :func:`pause_gc` turned it off."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        if freeze:
            gc.freeze()
        gc.enable()


def hold_gc_in_worker() -> None:
    """Worker start-up hook entry: the cyclic collector stays off while the script sets up
    (imports torch and what ``DistributedDataParallel`` and the optimizers import, ~2 000
    modules, builds its model), until :func:`release_worker_gc`: at the end of the first
    ``tg.step()``, or :data:`~trainguard.core.contracts.envvars.GC_HOLD_S` seconds after the
    start at the latest. Collections triggered by the import's object count walk every object
    so far each time: ~25 % of a cold worker's start-up CPU (0.5-1 s), on a restart's critical
    path. Nothing is frozen: what the script drops later is collected as usual (one full
    collection at the release ages the set-up's objects at once). Does nothing
    where the variable is unset or 0, or the collector is already off."""
    try:
        hold_s = float(os.environ.get(envvars.GC_HOLD_S, "0") or 0)
    except ValueError:
        return
    global _gc_held
    with _gc_hold_lock:
        if hold_s <= 0 or not gc.isenabled():
            return
        gc.disable()
        _gc_held = True
    # a process forked meanwhile (a DataLoader's workers) has no timer: its collector runs
    os.register_at_fork(after_in_child=_release_in_child)
    timer = threading.Timer(hold_s, release_worker_gc)
    timer.name, timer.daemon = "trainguard-gc-hold", True
    timer.start()


def _release_in_child() -> None:
    global _gc_held
    if _gc_held:
        _gc_held = False
        gc.enable()


def release_worker_gc() -> None:
    """End :func:`hold_gc_in_worker`'s hold (the collector back on); once, from whichever comes
    first: the first step's end or the hold's time limit. Does nothing otherwise."""
    global _gc_held
    if not _gc_held:  # the step path's check, without the lock
        return
    with _gc_hold_lock:
        if _gc_held:
            _gc_held = False
            gc.enable()
            # everything allocated during the hold is in the youngest generation: one full
            # collection now (a fraction of a second once) ages it all at once, where the
            # collector's own triggers would walk it generation by generation
            gc.collect()


def kill_ranks(pids: dict[int, int]) -> list[int]:
    """SIGKILL each rank's process (a stopped one ignores SIGTERM); returns the ranks killed
    (a process already gone is not one of them)."""
    killed = []
    for rank, pid in sorted(pids.items()):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(rank)
        except ProcessLookupError:
            pass
        except OSError as e:
            logger.warning("cannot kill rank %d (pid %d): %s", rank, pid, e)
    return killed


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` once its atexit handlers ran and its output is flushed,
    skipping the interpreter's teardown. After a peer or a worker died, torch's C++ objects
    (a process group's or a store's threads) can be destroyed during that teardown while their
    threads still run, and the process then aborts ("terminate called without an active
    exception", SIGABRT): its decided exit code (0, 1, the requeue code) would read as -6."""
    try:
        atexit._run_exitfuncs()  # prints and swallows a handler's exception itself
    except BaseException:  # noqa: BLE001 - nothing may stand between the process and its code
        pass
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
