"""The save pipeline of one rank: staging copies and CUDA streams, the persist thread, and the
outcome of every save (:class:`SaveResult`).

::

    main thread     build state dict → pick a free slot → copy buffers/extras (sync)
                    → hand parameters + optimizer state to the stager, return
    stager thread   copy the rest into the slot (overlapping forward/backward; the next
                    ``optimizer.step()`` waits for it) → publish the memory-tier snapshot
                    → queue the persist
    persist thread  DCP save of the slot (thread mode), or hand it to the persister process
                    (``persist_mode = "process"``) → the outcome → retention (rank 0)

The collective decisions around it (persist now? skip?) are the manager's
(:mod:`trainguard.checkpoint.manager`); the persister process's life is
:mod:`trainguard.checkpoint.supervisor`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from trainguard.checkpoint import jsoncodec
from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.faults import Faults
from trainguard.checkpoint.interval import IntervalPolicy
from trainguard.checkpoint.memory_cadence import MemoryCadence
from trainguard.checkpoint.persist import Writer
from trainguard.checkpoint.staging import (
    Layout,
    SlotPool,
    as_dtensors,
    dtensor_infos,
    flatten,
    local_tensor,
    unflatten,
)
from trainguard.checkpoint.state import build_state_dict, optimizer_tensor_ptrs, rng_key, rng_state
from trainguard.checkpoint.storage import Storage
from trainguard.core.config.checkpoint import CheckpointConfig
from trainguard.core.failures import peer_failure

if TYPE_CHECKING:
    from trainguard.checkpoint.supervisor import PersisterSupervisor

__all__ = ["SavePipeline", "SaveResult"]

logger = logging.getLogger(__name__)

INLINE_STAGING_BYTES = 1 << 20
"""A CPU state up to this size is copied and published on the caller's thread: waking the
stager thread (and handing the interpreter to it and back) costs more than the copy, and the
snapshot is complete when ``save`` returns (a worker killed right after it resumes from it)."""

EventFn = Callable[..., object]
MetricFn = Callable[..., object]
CopyPairs = list[tuple[torch.Tensor, torch.Tensor]]


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
        self.staging_cpu_s = 0.0
        """CPU time the stager thread spent on this save's copies and snapshot metadata."""
        self.in_step_stall_s = 0.0
        """The part of ``stall_s`` waited inside the training step (the optimizer's step)."""
        self.persist_s = 0.0
        self.commit_s = 0.0
        self.marks: dict[str, str] = {}
        """What the manifest records of the saved state beyond its files (``extra``)."""
        self.num_bytes = 0
        self.via_process = False
        """Persisted by the persister process (else in the worker's persist thread)."""

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


def _copy_all(pairs: CopyPairs) -> None:
    """``dst.copy_(src)`` for every pair, in one call for the tensors of one device (a
    snapshot holds hundreds of small tensors: a call each is mostly interpreter time, which
    the training thread would wait for)."""
    cpu = [(s, d) for s, d in pairs if not s.is_cuda and not d.is_cuda]
    if cpu:
        torch._foreach_copy_([d for _, d in cpu], [s for s, _ in cpu])
    for src, dst in pairs:
        if src.is_cuda or dst.is_cuda:
            dst.copy_(src)


class SavePipeline:
    """One rank's saves, from the caller's copy to the persist's outcome (module docstring).

    ``memory_dir`` is the node's memory tier the slots live in (None: private buffers, or
    process mode's private shared-memory directory); it drops to None when the tier fails.
    """

    def __init__(
        self,
        *,
        config: CheckpointConfig,
        rank: int,
        world_size: int,
        pool: SlotPool,
        memory_dir: Path | None,
        writer: Writer,
        storage: Storage,
        faults: Faults,
        interval: IntervalPolicy,
        memory_cadence: MemoryCadence,
        supervisor: PersisterSupervisor,
        emit: EventFn,
        metric: MetricFn,
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.pool = pool
        self.memory_dir = memory_dir
        self.writer = writer
        self.storage = storage
        self.faults = faults
        self.interval = interval
        self.memory_cadence = memory_cadence
        self.supervisor = supervisor
        self._emit = emit
        self._metric = metric
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="tg-ckpt-stage")
        self._persister = ThreadPoolExecutor(1, thread_name_prefix="tg-ckpt-persist")
        self._staging: Future[None] | None = None
        self._staging_result: SaveResult | None = None
        self._cuda_event: Any = None
        self._cuda_stream: Any = None
        self.persisting: SaveResult | None = None
        """The persisting save in flight (None once it ended)."""
        self.num_failures = 0
        self.staged_bytes = 0
        """The size of the last save's state on this rank."""
        self.last_result: SaveResult | None = None
        """The last persisting save."""

    # -- staging (main and stager threads) -------------------------------------------------------
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        persist: bool,
        via_process: bool = False,
        marks: dict[str, str] | None = None,
    ) -> SaveResult:
        """Stage ``state`` as of ``step`` and queue its persist when ``persist`` (through the
        persister process when ``via_process``, else in the persist thread); returns once the
        caller may go on (see the module docstring)."""
        t0 = time.perf_counter()
        self.wait_staged()
        result = SaveResult(step, persist)
        result.via_process = via_process
        result.marks = dict(marks or {})
        self.last_result = result if persist else (self.last_result or None)
        sd = build_state_dict(state)
        sd["_trainguard_step"] = step
        if self.config.capture_rng:
            sd[rng_key(self.rank)] = rng_state()
        skeleton, tensors = flatten(sd, copy_leaves=True)  # non-tensor leaves as of now
        layout = Layout.of(tensors)
        slot = self._acquire_slot(layout)
        slot.invalidate()
        if persist:
            slot.persisting = True
            self.persisting = result
        result.num_bytes = self.staged_bytes = layout.nbytes
        inline = layout.nbytes <= INLINE_STAGING_BYTES and not any(
            local_tensor(t).is_cuda for t in tensors
        )
        late, event = self._copy_early(state, tensors, slot.views, inline=inline)
        infos = dtensor_infos(tensors)
        self._staging_result = result
        if inline:  # a small state: copying it costs less than waking the stager
            self._finish_staging(result, slot, late, event, skeleton, infos, t0)
            result.staging_cpu_s = 0.0  # on this thread: part of the stall
        else:
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

    def stage_into(self, directory: Path) -> None:
        """Stage into files in ``directory`` from the next save on (no save in flight)."""
        self.pool.close()
        self.pool = SlotPool(directory=directory, pin=self.pool.pin)

    def _acquire_slot(self, layout: Layout) -> Any:
        """A free staging slot for ``layout``; private buffers when the memory tier fails."""
        try:
            slot = self.pool.acquire(layout)
        except OSError as e:  # e.g. /dev/shm too small: keep going without the memory tier
            logger.warning("memory tier unavailable (%s); staging into private buffers", e)
            self._emit("checkpoint_memory_tier_disabled", rank=self.rank, error=str(e))
            self.pool.close()
            self.memory_dir = None
            self.pool = SlotPool(directory=None, pin=self.pool.pin)
            slot = self.pool.acquire(layout)
        if slot is None:  # both slots persisting: cannot happen with one persist in flight
            self.wait_persist()
            slot = self.pool.acquire(layout)
            assert slot is not None
        return slot

    def _copy_early(
        self,
        state: Mapping[str, Any],
        tensors: list[Any],
        views: list[torch.Tensor],
        *,
        inline: bool = False,
    ) -> tuple[CopyPairs, Any]:
        """Copy what must be copied before returning to training; the optimizer's tensors
        (``overlap_staging``, not ``inline``) are left for the stager (CPU) or a copy stream
        whose CUDA event the next ``optimizer.step()`` waits for. Returns the stager's copies
        and that event (``inline``: no copies left, one call for all of them)."""
        if inline:
            pairs = [
                (local_tensor(src).detach(), dst) for src, dst in zip(tensors, views, strict=True)
            ]
            _copy_all(pairs)
            return [], None
        late_ptrs = optimizer_tensor_ptrs(state) if self.config.overlap_staging else set()
        late: CopyPairs = []
        cuda_late: CopyPairs = []
        for src, dst in zip(tensors, views, strict=True):
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
            _copy_all(late)
            late = []
        if any(t.is_cuda for t in tensors) and event is None:
            torch.cuda.current_stream().synchronize()
        return late, event

    def _issue_cuda_copies(self, pairs: CopyPairs) -> Any:
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
        late: CopyPairs,
        event: Any,
        skeleton: Any,
        infos: list[Any],
        t0: float,
    ) -> None:
        c0 = time.thread_time()
        _copy_all(late)
        if event is not None:
            event.synchronize()
        self.faults.point("staged", result.step, self.rank)
        slot.publish(
            step=result.step, rank=self.rank, world_size=self.world_size, skeleton=skeleton
        )
        result.staging_cpu_s = time.thread_time() - c0
        result._staged.set()
        if result.persist:
            self._persister.submit(self._persist_safe, result, slot, skeleton, infos, t0)

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer step pre-hook: the step must not change what is still copying."""
        if self._staging is None:
            return
        if self._cuda_event is not None and self._staging_result is not None:
            # GPU: make the optimizer's kernels wait for the copy; the CPU does not block.
            torch.cuda.current_stream().wait_event(self._cuda_event)
            self._cuda_event = None
            return
        self.wait_staged(in_step=True)

    def wait_staged(self, *, in_step: bool = False) -> None:
        """Block until the last save's copy is complete (``in_step``: inside the training
        step, at the optimizer step, not in a call to trainguard)."""
        fut = self._staging
        if fut is None:
            return
        t0 = time.perf_counter()
        fut.result()
        self._staging = None
        if self._staging_result is not None:
            waited = time.perf_counter() - t0
            self._staging_result.stall_s += waited
            if in_step:
                self._staging_result.in_step_stall_s += waited
            self._record_stall(self._staging_result)

    def _record_stall(self, result: SaveResult) -> None:
        self._staging_result = None
        self._metric(step=result.step, checkpoint_stall_s=result.stall_s)
        self.interval.record_stall(result.stall_s)
        if not result.persist:
            # the stager's CPU time too: it shares the cores (and the interpreter) with training
            self.memory_cadence.record_stall(
                result.stall_s, background_s=result.staging_cpu_s, in_step_s=result.in_step_stall_s
            )

    def discard_after(self, step: int) -> None:
        """Invalidate the snapshots of steps after ``step`` (none of them persisting)."""
        self.wait_staged()
        for slot in self.pool.slots:
            if slot.step is not None and slot.step > step and not slot.persisting:
                slot.invalidate()

    # -- waiting for the persist in flight -------------------------------------------------------
    def persist_wait_s(self) -> float:
        """The longest wait for a persist in flight: the persister's own deadline, and a margin
        for the parent's side of it."""
        return self.config.persist_timeout_s + 10.0

    def busy(self) -> bool:
        """A persist is in flight."""
        return self.persisting is not None and not self.persisting.done.is_set()

    def wait_persist(self) -> bool:
        """Wait for the persist in flight, at most :meth:`persist_wait_s`; False (and that save
        declared failed) if it did not end by then."""
        self.wait_staged()
        res = self.persisting
        if res is None or res.done.wait(self.persist_wait_s()):
            return True
        if not res.timed_out:
            res.timed_out = True
            res.error = res.error or f"persist did not finish within {self.persist_wait_s():g} s"
            self._failed(res.step, "timeout", res.error)
        return False

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for staging and the persist in flight; True if the last persist committed."""
        self.wait_staged()
        res = self.persisting
        if res is not None:
            res.done.wait(self.persist_wait_s() if timeout is None else timeout)
        return self.last_result.committed if self.last_result is not None else True

    def refuse(self, step: int, reason: str) -> SaveResult:
        """The outcome of a persisting save refused at once (training goes on)."""
        result = SaveResult(step, True)
        result.error = reason
        result._staged.set()
        result.done.set()
        self.last_result = result
        self._failed(step, "busy", reason)
        return result

    def _failed(self, step: int, reason: str, error: str | None, *, logged: bool = False) -> None:
        """A save that ends without a commit: a ``checkpoint_failed`` event and the failure
        counter (``reason``: ``error``, ``timeout`` or ``busy``); ``logged``: said already."""
        self.num_failures += 1
        if not logged:
            logger.warning("rank %s: checkpoint save of step %s failed: %s", self.rank, step, error)
        self._emit("checkpoint_failed", step=step, rank=self.rank, reason=reason, error=error)
        self._metric(step=step, checkpoint_failures=self.num_failures)

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
            in_process = result.via_process and self.supervisor.proc is not None
            if result.timed_out and in_process:  # the persister did not answer
                self._failed(result.step, "timeout", result.error)
            elif not result.committed and not result.timed_out:
                self._failed(result.step, "error", result.error, logged=True)
            result.done.set()
            if self.persisting is result:
                self.persisting = None
        if result.committed and self.rank == 0 and not in_process:
            try:  # after the outcome: deleting old checkpoints is not part of the commit
                self.writer.retention()
            except Exception:
                logger.exception("retention after step %s failed", result.step)

    def _persist(
        self, result: SaveResult, slot: Any, skeleton: Any, infos: list[Any], t0: float
    ) -> None:
        tp = time.perf_counter()
        proc = self.supervisor.proc if result.via_process else None
        if proc is not None and slot.directory is not None and not any(infos):
            committed, error = proc.persist(
                {
                    "step": result.step,
                    "bin_path": str(slot.bin_path),
                    "nbytes": slot.layout.nbytes,
                    "entries": [list(e) for e in slot.layout.entries],
                    "skeleton": jsoncodec.dumps(skeleton),
                    "marks": result.marks,
                }
            )
            result.timed_out = proc.timed_out
            if not committed and proc.broken is not None:
                # died after the manifest was renamed in (or a peer did): it did commit
                step_dir = self.writer.step_path(result.step)
                if mf.read_manifest(self.storage, step_dir) is not None:
                    committed, error = True, None
        else:  # thread mode (or DTensor state, which needs the device mesh of this process)
            staged = unflatten(skeleton, as_dtensors(slot.views, infos))
            committed, error = self.writer.write_and_commit(result.step, staged, marks=result.marks)
        result.committed = committed
        result.error = error
        result.persist_s = time.perf_counter() - tp
        result.commit_s = time.perf_counter() - t0
        self.interval.persisted()
        if committed:
            self._committed(result, process=proc is not None)

    def _committed(self, result: SaveResult, *, process: bool) -> None:
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
                path=self.writer.step_path(result.step),
                bytes=result.num_bytes * self.world_size,
                persist_s=round(result.persist_s, 4),
                commit_s=round(result.commit_s, 4),
                stall_s=round(result.stall_s, 4),
                persist_mode="process" if process else "thread",
                sdc=result.marks.get("sdc"),
                sdc_reason=result.marks.get("sdc_reason"),
            )

    # -- shutdown --------------------------------------------------------------------------------
    def stop_threads(self) -> None:
        """Stop the stager and persist threads (not waiting for a persist past its deadline)."""
        res = self.persisting
        stuck = res is not None and not res.done.is_set()
        self._stager.shutdown(wait=True)
        self._persister.shutdown(wait=not stuck)

    def release(self) -> None:
        """Free private staging buffers (the memory tier's snapshots stay for a restore)."""
        if self.memory_dir is None:
            self.pool.close()
