"""In-process restarts, the worker's side: ``trainguard.run(fn)`` / ``@trainguard.restartable``.

``fn(tg, *args, **kwargs)`` is the whole training: build the model, ``tg.checkpoint.
restore_or_init(state)``, the step loop. ``run`` creates the default process group before each
call and destroys it after. Under ``trainguard run`` (``[inprocess] enabled``, the default),
when another local rank dies:

- this rank's next collective fails (gloo: the peer's sockets closed) or, between
  collectives, the watchdog thread sees the agent announce the next generation in the round's
  worker store and ``tg.step()`` raises :class:`RestartRequested` at the next step boundary
  (on CUDA the watchdog also aborts the NCCL communicators, which unblocks a stuck kernel);
- ``run`` closes the checkpoint manager, destroys the process group, waits for the agent's
  announcement (the agent has started a replacement for the dead rank), creates generation
  ``g+1``'s process group under a new store prefix with the replacement, and calls ``fn``
  again: the restore finds the newest step every rank holds in the node's memory tier (at most
  one step old when the tier snapshots every step).

The process, its imports, CUDA context and data loaders' workers survive; only the dead rank
pays a process start. An exception that is not a peer's failure (a bug in ``fn``) is raised
as usual after a short wait for an announcement; a restart that cannot complete exits with
:data:`FALLBACK_EXIT_CODE` and the agent restarts the whole group. Anchored on NVIDIA
resiliency-ext's in-process ``Wrapper`` (a store-based generation protocol, a monitor thread
that aborts the process group, a restart exception derived from ``BaseException``).

Outside ``trainguard run`` (torchrun, plain python) ``run`` calls ``fn`` once.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from trainguard.core.config import load_worker_section
from trainguard.core.failures import peer_failure
from trainguard.core.inprocess import (
    FALLBACK_EXIT_CODE,
    GEN_KEY,
    announce_key,
    pg_prefix,
    ready_key,
)

if TYPE_CHECKING:
    from trainguard.core.config.inprocess import InProcessConfig
    from trainguard.worker.api import TrainGuard

__all__ = ["RestartRequested", "restartable", "run"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

WATCH_INTERVAL_S = 0.1
"""How often the watchdog thread looks for the agent's announcement of a new generation."""

UNKNOWN_ERROR_WAIT_S = 2.0
"""How long an error that does not look like a peer's failure waits for the agent's
announcement before it is raised as this rank's own failure."""


class RestartRequested(BaseException):  # noqa: N818 (a control-flow signal, like SystemExit)
    """Raised at a step boundary when the agent started a new generation (another rank died).
    A ``BaseException`` so ``except Exception`` in the training code does not swallow it."""


def restartable(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorator: ``@trainguard.restartable def train(tg): ...``; ``train()`` then runs as
    ``trainguard.run(train)``."""

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: Any) -> T:
        return run(fn, *args, **kwargs)

    return wrapper


def run(fn: Callable[..., T], *args: object, backend: str | None = None, **kwargs: object) -> T:
    """Run ``fn(tg, *args, **kwargs)`` in a fresh default process group (``backend``: torch's
    default for the devices present), restarting it in this process when another rank fails
    (see the module docstring). Returns what ``fn`` returns."""
    from trainguard.worker.api import init

    tg = init()
    ctl = _Controller.create(tg, backend)
    if ctl is None:
        return _run_once(tg, fn, backend, args, kwargs)
    return ctl.loop(fn, args, kwargs)


def _run_once(
    tg: TrainGuard, fn: Callable[..., T], backend: str | None, args: Any, kwargs: Any
) -> T:
    import torch.distributed as dist

    own = tg.world_size > 1 and not dist.is_initialized()
    if own:
        dist.init_process_group(backend)
    try:
        result = fn(tg, *args, **kwargs)
        if own:
            dist.barrier()  # leave together (gloo can abort a process whose peer is gone)
        return result
    finally:
        if own and dist.is_initialized():
            dist.destroy_process_group()


class _Controller:
    _result: Any  # the script's return value, once it returned
    _exc: BaseException | None  # this rank's own error of the last generation
    """The generation loop of one worker."""

    def __init__(self, tg: TrainGuard, backend: str | None, cfg: InProcessConfig) -> None:
        from torch.distributed import TCPStore

        self.tg = tg
        self.backend = backend
        self.cfg = cfg
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        timeout = timedelta(seconds=cfg.join_timeout_s)
        self.store = TCPStore(addr, port, is_master=False, timeout=timeout)
        self._watch_store = TCPStore(addr, port, is_master=False, timeout=timeout)
        self._announced = threading.Event()
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.generation = -1

    @classmethod
    def create(cls, tg: TrainGuard, backend: str | None) -> _Controller | None:
        env = os.environ
        if not tg.under_agent or tg.world_size < 2 or "MASTER_PORT" not in env:
            return None
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError(
                "trainguard.run(fn): the default process group already exists; let run() "
                "create it (remove init_process_group before run, or call fn directly)"
            )
        cfg = load_worker_section(tg.run_dir, "inprocess")
        if not cfg.enabled:
            return None
        return cls(tg, backend, cfg)

    # -- the loop --------------------------------------------------------------------------------
    def loop(self, fn: Callable[..., T], args: Any, kwargs: Any) -> T:
        tg = self.tg
        tg.in_process = True
        self.store.set(ready_key(tg.rank), str(os.getpid()))
        try:
            return self._loop(fn, args, kwargs)
        finally:
            self._stop_watch()

    def _loop(self, fn: Callable[..., T], args: Any, kwargs: Any) -> T:
        tg = self.tg
        gen = self._current()
        while True:
            gen = self._join(gen)
            error = self._call(fn, args, kwargs)
            if error is None:
                return self._result
            reason, wait_s = error
            t_fail = time.time()
            if reason is None:  # this rank's own error, unless a restart is announced soon
                new = self._wait_announced(gen, wait_s)
                if new is None:
                    exc, self._exc = self._exc, None
                    assert exc is not None
                    raise exc
                self._exc = None
                self._teardown()
            else:
                self._teardown()
                new = self._wait_announced(gen, wait_s)
            if new is None:
                print(
                    f"rank {tg.rank}: a peer rank failed ({reason}) and no in-process restart "
                    f"was announced within {wait_s:g} s; exiting for a group restart",
                    file=sys.stderr,
                    flush=True,
                )
                raise SystemExit(FALLBACK_EXIT_CODE)
            self._exc = None
            tg.events.emit(
                "inprocess_rejoin",
                from_generation=gen,
                generation=new,
                reason=reason or "announced",
                failed_step=tg.step_num,
                wait_s=round(time.time() - t_fail, 4),
            )
            gen = new

    def _call(
        self, fn: Callable[..., T], args: Any, kwargs: Any
    ) -> tuple[str | None, float] | None:
        """Run ``fn`` once. None when it returned (``self._result``), else (the peer failure
        or None for another error, how long to wait for an announcement); the exception is
        kept in ``self._exc`` (its traceback dropped after the teardown decision)."""
        import torch.distributed as dist

        self._exc = None
        try:
            self._result = fn(self.tg, *args, **kwargs)
            if dist.is_initialized():
                dist.barrier()  # leave together; a peer dying now re-runs the (restored) end
            self._stop_watch()
            if dist.is_initialized():
                dist.destroy_process_group()
            return None
        except (KeyboardInterrupt, SystemExit):
            raise
        except RestartRequested:
            return "restart announced", self.cfg.detect_timeout_s
        except BaseException as e:
            peer = peer_failure(e)
            if peer is None and not self._announced.is_set():
                self._exc = e
                return None, UNKNOWN_ERROR_WAIT_S
            logger.info("rank %s: generation %s failed: %s", self.tg.rank, self.generation, e)
            return peer or "restart announced", self.cfg.detect_timeout_s

    # -- generations -----------------------------------------------------------------------------
    def _current(self) -> int:
        return int(self.store.add(GEN_KEY, 0))

    def _join(self, gen: int) -> int:
        """Create generation ``gen``'s (or a newer one's) default process group."""
        import torch.distributed as dist

        while True:
            t0 = time.monotonic()
            try:
                dist.init_process_group(
                    self.backend,
                    store=dist.PrefixStore(pg_prefix(gen), self.store),
                    rank=self.tg.rank,
                    world_size=self.tg.world_size,
                    timeout=timedelta(seconds=self.cfg.join_timeout_s),
                )
            except Exception as e:
                newer = self._current()
                if dist.is_initialized():
                    dist.destroy_process_group()
                if newer > gen:  # the generation died while forming: join the next one
                    gen = newer
                    continue
                print(
                    f"rank {self.tg.rank}: could not form in-process generation {gen} "
                    f"({type(e).__name__}: {e}); exiting for a group restart",
                    file=sys.stderr,
                    flush=True,
                )
                raise SystemExit(FALLBACK_EXIT_CODE) from None
            break
        self.generation = gen
        self.tg.generation = gen
        self._announced.clear()
        self._start_watch(gen)
        if gen:
            logger.info(
                "rank %s joined generation %s in %.3f s", self.tg.rank, gen, time.monotonic() - t0
            )
        return gen

    def _start_watch(self, gen: int) -> None:
        self._watch_stop = stop = threading.Event()
        announced = self._announced
        store = self._watch_store
        key = announce_key(gen + 1)

        def watch() -> None:
            # polls (a cheap ``check``): a blocking ``wait`` could not be interrupted, and a
            # thread inside the store's C++ code at interpreter exit aborts the process
            while not stop.wait(WATCH_INTERVAL_S):
                try:
                    if not store.check([key]):
                        continue
                except Exception:  # the store is gone (the agent is ending the round)
                    return
                announced.set()
                _abort_device_communicators()
                return

        self._watcher = threading.Thread(target=watch, name="tg-inprocess-watch", daemon=True)
        self._watcher.start()
        self.tg._step_guard = self._guard

    def _stop_watch(self) -> None:
        self._watch_stop.set()
        self.tg._step_guard = None
        if self._watcher is not None:
            self._watcher.join(timeout=5.0)
            self._watcher = None

    def _guard(self) -> None:
        if self._announced.is_set():
            raise RestartRequested(f"generation {self.generation + 1} was announced")

    def _wait_announced(self, gen: int, timeout_s: float) -> int | None:
        """The newest generation after ``gen`` once the agent announced one, else None."""
        try:
            self.store.wait([announce_key(gen + 1)], timedelta(seconds=timeout_s))
        except Exception:
            return None
        return self._current()

    def _teardown(self) -> None:
        """Release everything of the failed generation: the watchdog, the checkpoint manager
        (its process groups), the default process group; then the garbage it leaves."""
        import torch.distributed as dist

        tg = self.tg
        self._stop_watch()
        ckpt, tg._checkpoint = tg._checkpoint, None
        if ckpt is not None:
            try:
                ckpt.close()
            except Exception as e:
                logger.warning("rank %s: closing the checkpoint manager: %s", tg.rank, e)
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as e:
            logger.warning("rank %s: destroying the process group: %s", tg.rank, e)
        gc.collect()


def _abort_device_communicators() -> None:
    """NCCL's communicators can be aborted from another thread (which unblocks a kernel
    waiting on a dead peer); gloo's cannot (its collectives fail on the peer's closed sockets)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            from trainguard.core._torch import abort_backend

            abort_backend(dist.group.WORLD, torch.device("cuda"))
    except Exception as e:  # best effort: the collective's own error follows
        logger.debug("aborting the NCCL communicators failed: %s", e)
