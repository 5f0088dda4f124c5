"""The worker-side checkpoint manager: ``tg.checkpoint``.

Save path (``save``/``maybe_save``)::

    main thread     build state dict → pick a free slot → copy buffers/extras (sync)
                    → hand parameters + optimizer state to the stager, return
    stager thread   copy the rest into the slot (overlapping forward/backward; the next
                    ``optimizer.step()`` waits for it) → publish the memory-tier snapshot
                    → queue the persist
    persist thread  DCP save of the slot on the checkpoint gloo group (checksummed, fsynced)
                    → gather every rank's files → rank 0 renames the manifest into place
                    → everyone learns the outcome → retention (rank 0)
    (``persist_mode = "process"``: the same, in a persister process per rank that maps the
    slot; see trainguard.checkpoint.persist_proc)

Failure semantics: a failed persist (ENOSPC, I/O error, a dead peer) is reported as a
``checkpoint_failed`` event and a metric; it never raises into training and never touches
committed checkpoints. Collective decisions (persist now? skip? preempted?) are taken with one
small all-reduce on a control group so every rank makes the same choice.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from trainguard.checkpoint import jsoncodec
from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.faults import Faults
from trainguard.checkpoint.interval import (
    IntervalPolicy,
    observed_memory_fraction,
    observed_mtbf_s,
)
from trainguard.checkpoint.memory_cadence import MemoryCadence
from trainguard.checkpoint.persist import Writer
from trainguard.checkpoint.preemption import Preemption
from trainguard.checkpoint.staging import (
    Layout,
    SlotPool,
    as_dtensors,
    dtensor_infos,
    flatten,
    local_tensor,
    rank_dir,
    unflatten,
)
from trainguard.checkpoint.state import build_state_dict, optimizer_tensor_ptrs, rng_key, rng_state
from trainguard.checkpoint.storage import ChecksummingFileSystem, storage_for
from trainguard.core import envvars
from trainguard.core.config import load_worker_section
from trainguard.core.config.checkpoint import CheckpointConfig
from trainguard.core.failures import REQUEUE_EXIT_CODE, peer_failure
from trainguard.core.handles import WorkerHandle
from trainguard.core.rundir import RunDir

__all__ = ["CheckpointManager", "MEMORY_DIR_ENV", "SaveResult"]

logger = logging.getLogger(__name__)

MEMORY_DIR_ENV = envvars.CHECKPOINT_MEMORY_DIR
"""Set by the agent's memory-tier plugin: this node's shared-memory directory."""

INPROCESS_MAX_STALL_FRACTION = 0.1
"""``memory_max_stall_fraction`` when unset and the training runs in ``trainguard.run``."""
DEFAULT_MAX_STALL_FRACTION = 0.01
"""``memory_max_stall_fraction`` when unset otherwise: a process restart costs far more than
a step anyway, so the memory tier snapshots every step only while that stalls training by at
most 1 %, and every few steps where it would cost more (tiny steps, a huge state)."""

EventFn = Callable[..., Any]
MetricFn = Callable[..., Any]


class SaveResult:
    """Outcome of one ``save``. Two stages, two names:

    - ``staged``: the state is copied into the staging slot (and, with the memory tier, into
      this node's shared memory): it survives the worker, not the node;
    - ``committed``: the checkpoint is durably on disk (every rank's files fsynced and checked,
      the manifest renamed in). Only a persisting save (``persist=True``) ever commits.
    """

    def __init__(self, step: int, persist: bool) -> None:
        self.step = step
        self.persist = persist
        self._staged = threading.Event()
        self.done = threading.Event()
        """Set when this save will do nothing more (staged, and committed or failed)."""
        self.committed = False
        self.error: str | None = None
        self.timed_out = False
        """The persist did not finish within ``persist_timeout_s``: declared failed."""
        self.stall_s = 0.0
        self.persist_s = 0.0
        self.commit_s = 0.0
        self.num_bytes = 0

    @property
    def staged(self) -> bool:
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait for the copy into the staging slot / memory tier; True once staged."""
        return self._staged.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until this save is durably committed (or failed); True if it committed.

        A memory-only save (``persist=False``) never commits: this waits until it is staged
        and returns False; use :meth:`wait_staged` for those."""
        if not self.persist:
            self._staged.wait(timeout)
            return False
        self.done.wait(timeout)
        return self.committed


class CheckpointManager:
    """See the module docstring. One per worker process; ``close()`` when done.

    Creating the manager is local: no collective, no signal handler. :meth:`setup` is the
    collective step (two ``new_group`` calls and a barrier on every rank, the preemption
    signal handlers, the optimizer hook, the persister process); ``save``, ``maybe_save``,
    ``restore`` and ``restore_or_init``, which every rank calls anyway, call it first, so
    calling it explicitly is only needed to install the signal handlers early.
    """

    _instances = 0  # per process; part of the persister group's store prefix

    def __init__(
        self,
        *,
        config: CheckpointConfig | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        events: EventFn | None = None,
        metrics: MetricFn | None = None,
        memory_dir: str | os.PathLike[str] | None = None,
        filesystem_factory: Callable[[], ChecksummingFileSystem] | None = None,
        install_signal_handlers: bool = True,
    ) -> None:
        self.config = config or CheckpointConfig()
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if self._distributed else 0)
        self.world_size = world_size if world_size is not None else (
            dist.get_world_size() if self._distributed else 1
        )  # fmt: skip
        run_dir = Path(run_dir) if run_dir is not None else Path(".")
        self.root = self.config.dir or str(RunDir(run_dir).checkpoints)
        self.storage = storage_for(self.root)
        self._emit = events or (lambda kind, **f: None)
        self._metric = metrics or (lambda **m: None)
        self.faults = Faults.from_env()
        self._fs_factory = filesystem_factory
        self._install_signal_handlers = install_signal_handlers
        self._pg: Any = None  # the checkpoint gloo group (setup)
        self._ctl_pg: Any = None  # the control group of the collective decisions (setup)
        self._is_setup = False
        self._restore_listeners: list[Callable[[int], None]] = []
        self.rollback_hook: Any = None
        """Set by the worker handle (trainguard.worker.rollback.LossGuard): ``pending()`` is
        this rank's anomalous step or None; ``apply(bad_step, step, state)`` rolls back. The
        ranks agree on it in ``maybe_save``'s all-reduce."""
        CheckpointManager._instances += 1
        self._instance = CheckpointManager._instances
        self._init_staging(memory_dir)
        self._writer = Writer(
            root=self.root,
            storage=self.storage,
            config=self.config,
            rank=self.rank,
            world_size=self.world_size,
            faults=self.faults,
            fs_factory=filesystem_factory,
        )
        self._init_pipeline()
        self.interval = IntervalPolicy(self.config, on_change=self._interval_changed)
        self.memory_cadence = MemoryCadence(
            self.config.memory_every_steps,
            self.config.memory_max_stall_fraction or 0.0,
            on_change=self._memory_cadence_changed,
        )
        self.preemption = Preemption(self.config.preemption_signals)
        self._preempting = False
        self._remove_uncommitted()  # local (rank 0); setup's barrier orders it before any save

    def _init_pipeline(self) -> None:
        """The save pipeline's threads and its state between saves."""
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="tg-ckpt-stage")
        self._persister = ThreadPoolExecutor(1, thread_name_prefix="tg-ckpt-persist")
        self._staging: Future[None] | None = None
        self._staging_t0 = 0.0
        self._staging_result: SaveResult | None = None
        self._cuda_event: Any = None
        self._cuda_stream: Any = None
        self._persisting: SaveResult | None = None
        self._hook: Any = None
        self._closed = False
        self.num_failures = 0
        self.last_result: SaveResult | None = None

    def _init_staging(self, memory_dir: str | os.PathLike[str] | None) -> None:
        """Where saves stage: the node's memory tier, a private shared-memory directory for
        the persister process, or private buffers."""
        if memory_dir is None and self.config.memory_tier:
            memory_dir = os.environ.get(MEMORY_DIR_ENV) or None
        self.memory_dir = Path(memory_dir) if memory_dir else None
        self._proc: Any = None
        self._proc_gen = 0
        self._process_mode = False
        self._private_dir: Path | None = None  # process mode without the memory tier stages here
        self._private_lock: int | None = None  # its owner lock (see memtier.sweep)
        if self.config.persist_mode == "process":
            from trainguard.checkpoint import persist_proc

            self._process_mode = persist_proc.usable(self.config, self.world_size, self._fs_factory)
            if self._process_mode and self.memory_dir is None:
                self._private_dir, self._private_lock = persist_proc.private_staging_dir(
                    self.config.memory_root
                )
        slot_dir = rank_dir(self.memory_dir, self.rank) if self.memory_dir else self._private_dir
        self._pool = SlotPool(
            directory=slot_dir,
            pin=torch.cuda.is_available(),
            num_slots=self.config.memory_slots if memory_dir else 2,
        )

    def setup(self) -> None:
        """**Collective**: every rank calls it (directly or through ``save``, ``maybe_save``,
        ``restore``, ``restore_or_init``). Creates the checkpoint process groups, waits until
        rank 0 removed what a dead attempt left uncommitted, installs the preemption signal
        handlers and the optimizer hook, starts the persister process. Idempotent."""
        if self._is_setup:
            return
        if self._closed:
            raise RuntimeError("the checkpoint manager is closed")
        self._is_setup = True
        if self._distributed:
            timeout = _td(self.config.collective_timeout_s)
            self._pg = dist.new_group(backend="gloo", timeout=timeout)
            self._ctl_pg = dist.new_group(backend="gloo", timeout=timeout)
            self._writer.pg = self._pg
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._hook = register_optimizer_step_pre_hook(self._before_step)
        if self._install_signal_handlers:
            self.preemption.install()
        if self._pg is not None:  # rank 0 removed what a dead attempt left (constructor)
            dist.barrier(group=self._pg)
        if self._process_mode:
            self._start_persister()

    def on_restore(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(step)`` after a successful restore (the worker handle sets its step)."""
        self._restore_listeners.append(fn)

    # -- public API ------------------------------------------------------------------------------
    @property
    def has_memory_tier(self) -> bool:
        return self.memory_dir is not None

    def save(self, step: int, state: Mapping[str, Any], *, persist: bool = True) -> SaveResult:
        """Snapshot ``state`` as of ``step`` (the number of steps done = the step to resume
        from). Returns once training may go on; parameters and optimizer state may still be
        copying, and the next ``optimizer.step()`` waits for that. ``persist=False`` only
        refreshes the memory tier. Collective: every rank calls it with the same arguments."""
        self.setup()
        if not self._preempting:
            (preempt,) = self._agree(self.preemption.signum is not None)
            if preempt:  # a preemption notice came in: this save is the preemption save
                self._preempt_exit(step, state)
        return self._save_agreed(step, state, persist=persist)

    def _save_agreed(self, step: int, state: Mapping[str, Any], *, persist: bool) -> SaveResult:
        """``save`` once the ranks agreed there is no preemption to act on (``maybe_save``
        agrees on it together with its other flags: one all-reduce per step, not two)."""
        if persist and self._persisting is not None:
            # a dead peer persister fails it fast (gloo sees the close); a stuck one at the deadline
            if not self._wait_persist():
                return self._refused_save(step, "the previous save is still persisting")
        if persist and self._proc is not None:
            self._check_persister()
        return self._save(step, state, persist=persist)

    def maybe_save(self, step: int, state: Mapping[str, Any]) -> SaveResult | None:
        """Call once per step boundary on every rank. Saves to memory / disk as configured,
        and on a preemption signal saves, waits for the commit and exits with the requeue code."""
        if not self.config.enabled:
            return None
        self.setup()
        due = self.interval.due(step)
        busy = self._persisting is not None and not self._persisting.done.is_set()
        broken = self._proc is not None and self._proc.check() is not None
        hook = self.rollback_hook
        mem = self.has_memory_tier and self.memory_cadence.due(step)
        (preempt, due, busy, broken, mem), bad = self._agree_with_step(
            [self.preemption.signum is not None, due, busy, broken, mem],
            hook.pending() if hook is not None else None,
        )
        if bad is not None and hook is not None:  # a loss anomaly on some rank: roll back
            hook.apply(bad, step, state)
            return None
        if broken:  # before the skip decision: a save stuck behind a dead persister never ends
            self._check_persister()
            busy = False
        if preempt:
            self._preempt_exit(step, state)
        if due and busy and self.config.in_flight_policy == "skip":
            if self.rank == 0:
                self._emit("checkpoint_skipped", step=step, reason="persist in flight")
            due = False
        mem = mem and self.has_memory_tier  # any rank due: every rank snapshots
        if not (due or mem):
            return None
        if mem:
            self.memory_cadence.snapshotted(step)
        return self._save_agreed(step, state, persist=due)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for staging and the persist in flight; True if the last persist committed."""
        self.wait_staged()
        res = self._persisting
        if res is not None:
            res.done.wait(self._persist_wait_s() if timeout is None else timeout)
        return self.last_result.committed if self.last_result is not None else True

    def wait_staged(self) -> None:
        """Block until the last save's copy is complete (``optimizer.step()`` calls this)."""
        fut = self._staging
        if fut is None:
            return
        t0 = time.perf_counter()
        fut.result()
        self._staging = None
        if self._staging_result is not None:
            self._staging_result.stall_s += time.perf_counter() - t0
            self._record_stall(self._staging_result)

    def restore(
        self,
        state: MutableMapping[str, Any],
        *,
        use_memory: bool = True,
        max_step: int | None = None,
        min_step: int | None = None,
    ) -> int | None:
        """Load the newest good checkpoint into ``state`` (memory tier first when it has the
        newest step on every rank, else disk with checksums verified, falling back to older
        ones), at or before ``max_step`` when given (a rollback), at or after ``min_step``
        when given (``state`` is left as it is when there is none that new). Returns the
        saved step (the number of steps done), or None if there is none. Collective (it runs
        :meth:`setup` first)."""
        from trainguard.checkpoint.restore import Restorer

        self.setup()
        self.wait()
        step = Restorer(
            config=self.config,
            rank=self.rank,
            world_size=self.world_size,
            root=self.root,
            storage=self.storage,
            memory_dir=self.memory_dir,
            pg=self._pg,
            gather=self._writer.gather,
            emit=self._emit,
            metric=self._metric,
            max_step=max_step,
            min_step=min_step,
        ).run(state, use_memory=use_memory)
        if step is not None:
            for fn in self._restore_listeners:
                fn(step)
        return step

    def restore_or_init(
        self, state: MutableMapping[str, Any], init: Callable[[], None] | None = None
    ) -> int:
        """``restore``; if there is nothing to restore, call ``init`` and return 0. The
        step to resume from either way (the worker handle's ``step_num`` is set to it).
        Collective: every rank calls it; the first call runs :meth:`setup`."""
        step = self.restore(state)
        if step is None:
            if init is not None:
                init()
            step = 0
            for fn in self._restore_listeners:
                fn(step)
        return step

    def discard_snapshots_after(self, step: int) -> None:
        """Drop this rank's memory-tier snapshots of steps after ``step`` (after a rollback
        they belong to the abandoned timeline; a restore must never pick them)."""
        self.wait_staged()
        for slot in self._pool.slots:
            if slot.step is not None and slot.step > step and not slot.persisting:
                slot.invalidate()

    def interval_s(self) -> float | None:
        """The automatic interval in seconds (the planner's), or None when not in auto mode."""
        return self.interval.interval_s

    def close(self) -> None:
        """Wait for work in flight, then release threads, hooks and buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        except Exception:
            logger.exception("checkpoint work in flight failed at close")
        res = self._persisting
        stuck = res is not None and not res.done.is_set()  # past its deadline: not waited for
        if self._hook is not None:
            self._hook.remove()
        self.preemption.restore()
        self._stager.shutdown(wait=True)
        self._persister.shutdown(wait=not stuck)
        if self._proc is not None:
            self._proc.close()
        if not self.has_memory_tier:
            self._pool.close()
        if self._private_dir is not None:
            import shutil

            shutil.rmtree(self._private_dir, ignore_errors=True)
        if self._private_lock is not None:
            os.close(self._private_lock)
            self._private_lock = None

    # -- save internals --------------------------------------------------------------------------
    def _save(self, step: int, state: Mapping[str, Any], *, persist: bool) -> SaveResult:
        t0 = time.perf_counter()
        self.wait_staged()
        result = SaveResult(step, persist)
        self.last_result = result if persist else (self.last_result or None)
        sd = build_state_dict(state)
        sd["_trainguard_step"] = step
        if self.config.capture_rng:
            sd[rng_key(self.rank)] = rng_state()
        skeleton, tensors = flatten(sd)
        skeleton = copy.deepcopy(skeleton)  # non-tensor leaves as of now
        layout = Layout.of(tensors)
        try:
            slot = self._pool.acquire(layout)
        except OSError as e:  # e.g. /dev/shm too small: keep going without the memory tier
            logger.warning("memory tier unavailable (%s); staging into private buffers", e)
            self._emit("checkpoint_memory_tier_disabled", rank=self.rank, error=str(e))
            self._pool.close()
            self.memory_dir = None
            self._pool = SlotPool(directory=None, pin=self._pool.pin)
            slot = self._pool.acquire(layout)
        if slot is None:  # both slots persisting: cannot happen with one persist in flight
            self._wait_persist()
            slot = self._pool.acquire(layout)
            assert slot is not None
        slot.invalidate()
        if persist:
            slot.persisting = True
            self._persisting = result
        result.num_bytes = layout.nbytes
        late_ptrs = optimizer_tensor_ptrs(state) if self.config.overlap_staging else set()
        late: list[tuple[torch.Tensor, torch.Tensor]] = []
        cuda_late: list[tuple[torch.Tensor, torch.Tensor]] = []
        for src, dst in zip(tensors, slot.views, strict=True):
            src = local_tensor(src).detach()
            if src.untyped_storage().data_ptr() in late_ptrs:
                (cuda_late if src.is_cuda else late).append((src, dst))
            else:
                dst.copy_(src, non_blocking=src.is_cuda)
        event = None
        if cuda_late:
            # GPU: the optimizer's kernels will wait for the copy stream (no CPU block), so
            # the few CPU tensors of the optimizer (step counters) are copied right now.
            event = self._issue_cuda_copies(cuda_late)
            for src, dst in late:
                dst.copy_(src)
            late = []
        if any(t.is_cuda for t in tensors) and event is None:
            torch.cuda.current_stream().synchronize()
        infos = dtensor_infos(tensors)
        self._staging_result = result
        self._cuda_event = event
        self._staging = self._stager.submit(
            self._finish_staging, result, slot, late, event, skeleton, infos, t0
        )
        if not self.config.overlap_staging:
            self.wait_staged()
        result.stall_s += time.perf_counter() - t0
        if self._staging is None:
            self._record_stall(result)
        return result

    def _issue_cuda_copies(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        if self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream()
        s = self._cuda_stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(s)
        return ev

    def _finish_staging(
        self,
        result: SaveResult,
        slot: Any,
        late: list[tuple[torch.Tensor, torch.Tensor]],
        event: Any,
        skeleton: Any,
        infos: list[Any],
        t0: float,
    ) -> None:
        for src, dst in late:
            dst.copy_(src)
        if event is not None:
            event.synchronize()
        self.faults.point("staged", result.step, self.rank)
        slot.publish(
            step=result.step, rank=self.rank, world_size=self.world_size, skeleton=skeleton
        )
        result._staged.set()
        if result.persist:
            self._persister.submit(self._persist_safe, result, slot, skeleton, infos, t0)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._staging is None:
            return
        if self._cuda_event is not None and self._staging_result is not None:
            # GPU: make the optimizer's kernels wait for the copy; the CPU does not block.
            torch.cuda.current_stream().wait_event(self._cuda_event)
            self._cuda_event = None
            return
        self.wait_staged()

    def _record_stall(self, result: SaveResult) -> None:
        self._staging_result = None
        self._metric(step=result.step, checkpoint_stall_s=result.stall_s)
        self.interval.record_stall(result.stall_s)
        if not result.persist:
            self.memory_cadence.record_stall(result.stall_s)

    def _persist_wait_s(self) -> float:
        """The longest wait for a persist in flight: the persister's own deadline, and a margin
        for the parent's side of it."""
        return self.config.persist_timeout_s + 10.0

    def _wait_persist(self) -> bool:
        """Wait for the persist in flight, at most :meth:`_persist_wait_s`; False (and that save
        declared failed) if it did not end by then."""
        self.wait_staged()
        res = self._persisting
        if res is None or res.done.wait(self._persist_wait_s()):
            return True
        if not res.timed_out:
            res.timed_out = True
            res.error = res.error or f"persist did not finish within {self._persist_wait_s():g} s"
            self._save_failed(res.step, "timeout", res.error)
        return False

    def _save_failed(self, step: int, reason: str, error: str | None) -> None:
        """A save that ends without a commit for ``reason`` (a deadline): event and counter."""
        self.num_failures += 1
        logger.warning("rank %s: checkpoint save of step %s failed: %s", self.rank, step, error)
        self._emit("checkpoint_failed", step=step, rank=self.rank, reason=reason, error=error)
        self._metric(step=step, checkpoint_failures=self.num_failures)

    def _refused_save(self, step: int, reason: str) -> SaveResult:
        """The outcome of a persisting save refused at once (training goes on)."""
        result = SaveResult(step, True)
        result.error = reason
        result._staged.set()
        result.done.set()
        self.last_result = result
        self._save_failed(step, "busy", reason)
        return result

    # -- persist (persist thread) ----------------------------------------------------------------
    def _persist_safe(
        self, result: SaveResult, slot: Any, skeleton: Any, infos: list[Any], t0: float
    ) -> None:
        try:
            self._persist(result, slot, skeleton, infos, t0)
        except (Exception, CheckpointException) as e:  # never into training
            peer = peer_failure(e)
            if peer:  # another rank failed: the writer said so in one line already
                logger.debug(
                    "rank %s: checkpoint step %s not committed: a peer rank failed (%s)",
                    self.rank,
                    result.step,
                    peer,
                )
                result.error = result.error or f"a peer rank failed ({peer})"
            else:
                logger.exception("checkpoint persist of step %s failed", result.step)
                result.error = result.error or f"{type(e).__name__}: {e}"
        finally:
            slot.persisting = False
            if result.timed_out and self._proc is not None:  # the persister did not answer
                self._save_failed(result.step, "timeout", result.error)
            elif not result.committed and not result.timed_out:
                self.num_failures += 1
                self._emit(
                    "checkpoint_failed",
                    step=result.step,
                    rank=self.rank,
                    reason="error",
                    error=result.error,
                )
                self._metric(step=result.step, checkpoint_failures=self.num_failures)
            result.done.set()
            if self._persisting is result:
                self._persisting = None
        if result.committed and self.rank == 0 and self._proc is None:
            try:  # after the outcome: deleting old checkpoints is not part of the commit
                self._writer.retention()
            except Exception:
                logger.exception("retention after step %s failed", result.step)

    def _persist(
        self, result: SaveResult, slot: Any, skeleton: Any, infos: list[Any], t0: float
    ) -> None:
        tp = time.perf_counter()
        proc = self._proc
        if proc is not None and slot.directory is not None and not any(infos):
            committed, error = proc.persist(
                {
                    "step": result.step,
                    "bin_path": str(slot.bin_path),
                    "nbytes": slot.layout.nbytes,
                    "entries": [list(e) for e in slot.layout.entries],
                    "skeleton": jsoncodec.dumps(skeleton),
                }
            )
            result.timed_out = proc.timed_out
            if not committed and proc.broken is not None:
                # died after the manifest was renamed in (or a peer did): it did commit
                step_dir = self._writer.step_path(result.step)
                if mf.read_manifest(self.storage, step_dir) is not None:
                    committed, error = True, None
        else:  # thread mode (or DTensor state, which needs the device mesh of this process)
            staged = unflatten(skeleton, as_dtensors(slot.views, infos))
            committed, error = self._writer.write_and_commit(result.step, staged)
        path = self._writer.step_path(result.step)
        result.committed = committed
        result.error = error
        result.persist_s = time.perf_counter() - tp
        result.commit_s = time.perf_counter() - t0
        self.interval.persisted()
        if committed:
            self.interval.record_commit(result.commit_s)
            self._metric(
                step=result.step,
                checkpoint_persist_s=result.persist_s,
                checkpoint_commit_s=result.commit_s,
                checkpoint_bytes=result.num_bytes,
            )
            if self.rank == 0:
                self._emit(
                    "checkpoint_committed",
                    step=result.step,
                    path=path,
                    bytes=result.num_bytes * self.world_size,
                    persist_s=round(result.persist_s, 4),
                    commit_s=round(result.commit_s, 4),
                    stall_s=round(result.stall_s, 4),
                    persist_mode="process" if proc is not None else "thread",
                )

    # -- persister process -----------------------------------------------------------------------
    def _start_persister(self) -> None:
        """Start this rank's persister process (generation ``self._proc_gen``)."""
        from trainguard.checkpoint.persist_proc import PersisterProcess

        attempt = os.environ.get(envvars.ATTEMPT) or os.environ.get("TORCHELASTIC_RESTART_COUNT")
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        init = {
            "root": self.root,
            "config": dataclasses.asdict(self.config),
            "rank": self.rank,
            "world_size": self.world_size,
            "master_addr": os.environ.get("MASTER_ADDR"),
            "master_port": os.environ.get("MASTER_PORT"),
            "prefix": f"trainguard/ckpt-persist/{run_id}/{attempt}/{self._instance}/"
            f"{self._proc_gen}/",
            "timeout_s": self.config.collective_timeout_s,
            # the persister removes the private staging directory if its worker dies
            "cleanup_dir": str(self._private_dir) if self._private_dir else None,
        }
        self._proc = PersisterProcess(init, timeout_s=self.config.persist_timeout_s)
        self._emit_rank0("checkpoint_persister_started", pid=self._proc.pid, gen=self._proc_gen)

    def _check_persister(self) -> None:
        """Collective. If any rank's persister died, every rank replaces its own: the others
        may sit in a collective with the dead one, so all are killed (their saves in flight
        fail) and a new generation starts. If one could not start at all, every rank falls back
        to persisting in a thread."""
        proc = self._proc
        if proc is None:
            return
        broken, failed = self._agree(proc.check() is not None, proc.start_failed)
        if not broken:
            return
        reason = proc.broken
        proc.kill()
        if self._persisting is not None:
            self._persisting.done.wait(self._persist_wait_s())
        if self._ctl_pg is not None:  # no rank's old persister is still writing
            dist.barrier(group=self._ctl_pg)
        self._remove_uncommitted()
        if self._pg is not None:
            dist.barrier(group=self._pg)
        if failed:
            logger.warning("persister process unavailable (%s); persisting in a thread", reason)
            self._proc = None
            return
        logger.warning("rank %s: replacing the persister processes (%s)", self.rank, reason)
        self._emit_rank0(
            "checkpoint_persister_replaced", reason=reason or "another rank's persister died"
        )
        self._proc_gen += 1
        self._start_persister()

    def _emit_rank0(self, kind: str, **fields: Any) -> None:
        logger.info("%s %s", kind, fields)
        if self.rank == 0:
            self._emit(kind, **fields)

    def _remove_uncommitted(self) -> None:
        """Rank 0: remove step directories left uncommitted by a dead attempt or persister
        (nothing of this job is in flight: the constructor, or every persister is dead). The
        caller's barrier keeps every rank's next save after it."""
        if self.rank != 0:
            return
        for step, p in mf.step_dirs(self.storage, self.root).items():
            if mf.read_manifest(self.storage, p) is None:
                logger.info("removing uncommitted checkpoint step %s", step)
                self.storage.remove(p)

    # -- collective decisions, interval, preemption ----------------------------------------------
    def _agree(self, *flags: bool) -> list[bool]:
        if self._ctl_pg is None:
            return list(flags)
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._ctl_pg)
        return [bool(x) for x in t.tolist()]

    def _agree_with_step(
        self, flags: list[bool], step: int | None
    ) -> tuple[list[bool], int | None]:
        """:meth:`_agree` and, in the same all-reduce, the smallest ``step`` any rank
        reports (None: no rank reports one)."""
        if self._ctl_pg is None:
            return list(flags), step
        none = 1 << 62
        t = torch.tensor([int(f) for f in flags] + [-(none if step is None else step)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._ctl_pg)
        vals = [int(x) for x in t.tolist()]
        return [bool(x) for x in vals[:-1]], (None if vals[-1] == -none else -vals[-1])

    def _interval_changed(self, tau: float, stall: float, mtbf: float) -> None:
        self._metric(checkpoint_interval_s=tau)
        if self.rank == 0:
            self._emit("checkpoint_interval", interval_s=round(tau, 3), stall_s=stall, mtbf_s=mtbf)
        logger.info("checkpoint interval %.1f s (stall %.3f s, MTBF %.0f s)", tau, stall, mtbf)

    def _memory_cadence_changed(self, every: int, stall: float, step: float) -> None:
        logger.info(
            "memory tier every %d steps (stall %.4f s, step %.4f s, at most %g of training)",
            every,
            stall,
            step,
            self.memory_cadence.max_fraction,
        )
        if self.rank == 0:
            self._emit(
                "checkpoint_memory_cadence",
                every_steps=every,
                stall_s=round(stall, 6),
                step_s=round(step, 6),
                max_stall_fraction=self.memory_cadence.max_fraction,
            )

    def set_mtbf(self, mtbf_s: float) -> None:
        """Observed mean time between failures (the runtime feeds it; auto interval uses it)."""
        self.interval.set_mtbf(mtbf_s)

    def _preempt_exit(self, step: int, state: Mapping[str, Any]) -> None:
        self._preempting = True
        if self.rank == 0:
            self._emit("checkpoint_preempted", step=step, signal=self.preemption.name)
        result = self.save(step, state, persist=True)
        ok = result.wait(self._persist_wait_s())
        self.preemption.committed = ok
        if self.rank == 0:
            self._emit("checkpoint_preempt_saved", step=step, committed=ok, error=result.error)
        self.close()
        raise SystemExit(REQUEUE_EXIT_CODE)


def _td(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


def for_worker(tg: WorkerHandle) -> CheckpointManager:
    """The manager behind ``tg.checkpoint``: config, events and metrics from the handle; a
    restore sets the handle's step. Local (see :meth:`CheckpointManager.setup`)."""
    mgr = CheckpointManager(
        config=load_worker_section(Path(tg.run_dir), "checkpoint"),
        rank=tg.rank,
        world_size=tg.world_size,
        run_dir=tg.run_dir,
        events=tg.events.emit,
        metrics=tg.log,
    )
    if mgr.config.auto_interval:
        observed = observed_mtbf_s(Path(tg.run_dir))
        if observed is not None:
            mgr.set_mtbf(min(observed, mgr.config.mtbf_s))
        mgr.interval.set_memory_fraction(observed_memory_fraction(Path(tg.run_dir)))
    if mgr.config.memory_max_stall_fraction is None:
        mgr.memory_cadence.max_fraction = (
            INPROCESS_MAX_STALL_FRACTION
            if getattr(tg, "in_process", False)
            else DEFAULT_MAX_STALL_FRACTION
        )
    mgr.on_restore(lambda step: setattr(tg, "step_num", step))
    return mgr
