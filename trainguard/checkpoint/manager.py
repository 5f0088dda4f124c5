"""The worker-side checkpoint manager: ``tg.checkpoint``.

Save path (``save``/``maybe_save``): the state is staged into a slot (the node's memory tier
when there is one) while training goes on, then persisted: a DCP save on the checkpoint gloo
group (checksummed, fsynced), every rank's files gathered, rank 0 renames the manifest into
place, everyone learns the outcome. The pieces, one module each:

- :mod:`~trainguard.checkpoint.pipeline`: staging copies and CUDA streams, the persist
  thread, :class:`SaveResult`;
- :mod:`~trainguard.checkpoint.supervisor`: the persister process of ``persist_mode =
  "process"`` and its replacement when one dies;
- :mod:`~trainguard.checkpoint.consensus`: the ranks' collective decisions (persist now?
  skip? preempted? roll back?) in one small all-reduce on a control group, and the
  :class:`RollbackHook` a loss-rollback guard implements;
- :mod:`~trainguard.checkpoint.interval` and :mod:`~trainguard.checkpoint.memory_cadence`:
  when to persist and when to snapshot; :mod:`~trainguard.checkpoint.preemption`: the
  signal that asks for a last save.

This module ties them together behind the public API (``setup``, ``save``, ``maybe_save``,
``restore``, ``restore_or_init``, ``wait``, ``close``).

Failure semantics: a failed persist (ENOSPC, I/O error, a dead peer) is reported as a
``checkpoint_failed`` event and a metric; it never raises into training and never touches
committed checkpoints.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.consensus import Agreement, Consensus, RollbackHook, SdcHook
from trainguard.checkpoint.faults import Faults
from trainguard.checkpoint.interval import (
    IntervalPolicy,
    observed_memory_fraction,
    observed_mtbf_s,
)
from trainguard.checkpoint.memory_cadence import MemoryCadence
from trainguard.checkpoint.persist import Writer
from trainguard.checkpoint.persist_proc import AUTO_PROCESS_MIN_BYTES
from trainguard.checkpoint.pipeline import EventFn, MetricFn, SavePipeline, SaveResult
from trainguard.checkpoint.preemption import Preemption
from trainguard.checkpoint.staging import SlotPool, rank_dir
from trainguard.checkpoint.storage import ChecksummingFileSystem, storage_for
from trainguard.checkpoint.supervisor import PersisterSupervisor
from trainguard.core.config import load_worker_section
from trainguard.core.config.checkpoint import CheckpointConfig
from trainguard.core.contracts import envvars
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.failures import REQUEUE_EXIT_CODE
from trainguard.core.handles import WorkerHandle

__all__ = ["CheckpointManager", "MEMORY_DIR_ENV", "RollbackHook", "SaveResult"]

logger = logging.getLogger(__name__)

MEMORY_DIR_ENV = envvars.CHECKPOINT_MEMORY_DIR
"""Set by the agent's memory-tier plugin: this node's shared-memory directory."""

INPROCESS_MAX_STALL_FRACTION = 0.1
"""``memory_max_stall_fraction`` when unset and the training runs in ``trainguard.run``."""
DEFAULT_MAX_STALL_FRACTION = 0.01
"""``memory_max_stall_fraction`` when unset otherwise: a process restart costs far more than
a step anyway, so the memory tier snapshots every step only while that stalls training by at
most 1 %, and every few steps where it would cost more (tiny steps, a huge state)."""


AGREE_EVERY_S = 0.5
"""``maybe_save(overlap=True)``: the ranks agree at least this often (in training time): a
preemption notice, a loss anomaly or a time-based persist waits at most this long."""
MAX_AGREE_STEPS = 1000


def _make_private(root: str, run_dir: Path) -> None:
    """Create a local checkpoint root with the run's ``[runtime] dir_mode`` (0700 unless the
    group is given access): the committed checkpoints are the model's weights."""
    from trainguard.core.atomicfile import make_dirs
    from trainguard.core.config import worker_section_or_default

    try:
        if not Path(root).exists():
            make_dirs(root, worker_section_or_default(run_dir, "runtime").dir_mode_bits)
    except OSError as e:  # the first save reports it
        logger.debug("cannot create the checkpoint directory %s: %s", root, e)


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
        if "://" not in self.root:
            _make_private(self.root, run_dir)
        self.storage = storage_for(self.root)
        self._emit = events or (lambda kind, **f: None)
        self._metric = metrics or (lambda **m: None)
        self.faults = Faults.from_env()
        self._fs_factory = filesystem_factory
        self._install_signal_handlers = install_signal_handlers
        self._pg: Any = None  # the checkpoint gloo group (setup)
        self.consensus = Consensus()  # its control group comes with setup
        self._is_setup = False
        self._closed = False
        self._hook: Any = None  # the optimizer step pre-hook (setup)
        self._restore_listeners: list[Callable[[int], None]] = []
        self.rollback_hook: RollbackHook | None = None
        """Set by the worker handle (trainguard.worker.rollback.LossGuard); the ranks agree
        on its pending step in ``maybe_save``'s all-reduce."""
        self.sdc_hook: SdcHook | None = None
        """Set by the worker handle (trainguard.worker.sdc.SdcGuard): the replicas are compared
        before a persisting save, which goes ahead only from state that agreed."""
        CheckpointManager._instances += 1
        self.interval = IntervalPolicy(self.config, on_change=self._interval_changed)
        self.memory_cadence = MemoryCadence(
            self.config.memory_every_steps,
            self.config.memory_max_stall_fraction or 0.0,
            on_change=self._memory_cadence_changed,
        )
        self.preemption = Preemption(self.config.preemption_signals)
        self._preempting = False
        self.preempted = False
        """The preemption save ran (``maybe_save(exit_on_preemption=False)`` returned instead of
        exiting): the caller stops its loop and exits with the requeue code."""
        self._ahead: Agreement | None = None  # maybe_save(overlap=True)'s next agreement
        self._next_agreement: int | None = None  # ... and the boundary it is for
        self._writer = Writer(
            root=self.root,
            storage=self.storage,
            config=self.config,
            rank=self.rank,
            world_size=self.world_size,
            faults=self.faults,
            fs_factory=filesystem_factory,
        )
        pool, tier_dir = self._init_staging(memory_dir)
        self._supervisor = PersisterSupervisor(
            root=self.root,
            config=self.config,
            rank=self.rank,
            world_size=self.world_size,
            instance=CheckpointManager._instances,
            cleanup_dir=self._private_dir,
            consensus=self.consensus,
            emit=self._emit,
        )
        self._pipeline = SavePipeline(
            config=self.config,
            rank=self.rank,
            world_size=self.world_size,
            pool=pool,
            memory_dir=tier_dir,
            writer=self._writer,
            storage=self.storage,
            faults=self.faults,
            interval=self.interval,
            memory_cadence=self.memory_cadence,
            supervisor=self._supervisor,
            emit=self._emit,
            metric=self._metric,
        )
        self._remove_uncommitted()  # local (rank 0); setup's barrier orders it before any save

    def _init_staging(
        self, memory_dir: str | os.PathLike[str] | None
    ) -> tuple[SlotPool, Path | None]:
        """Where saves stage: the node's memory tier, a private shared-memory directory for
        the persister process, or private buffers. The slot pool and the memory tier's
        directory (None without one)."""
        if memory_dir is None and self.config.memory_tier:
            memory_dir = os.environ.get(MEMORY_DIR_ENV) or None
        tier_dir = Path(memory_dir) if memory_dir else None
        self._process_mode = False
        self._no_persister = False  # "auto": some rank cannot run a persister
        self._private_dir: Path | None = None  # process mode without the memory tier stages here
        self._private_lock: int | None = None  # its owner lock (see memtier.sweep)
        if self.config.persist_mode != "thread":  # "process", or "auto": where it can run
            from trainguard.checkpoint import persist_proc

            self._process_mode = persist_proc.usable(self.config, self.world_size, self._fs_factory)
            # "auto" makes the directory when its persister starts (a small state never does)
            if self._process_mode and tier_dir is None and self.config.persist_mode == "process":
                self._private_dir, self._private_lock = persist_proc.private_staging_dir(
                    self.config.memory_root
                )
        slot_dir = rank_dir(tier_dir, self.rank) if tier_dir else self._private_dir
        pool = SlotPool(
            directory=slot_dir,
            pin=torch.cuda.is_available(),
            num_slots=self.config.memory_slots if memory_dir else 2,
        )
        return pool, tier_dir

    def setup(self) -> None:
        """**Collective**: every rank calls it (directly or through ``save``, ``maybe_save``,
        ``restore``, ``restore_or_init``). Creates the checkpoint process groups, waits until
        rank 0 removed what a dead attempt left uncommitted, installs the preemption signal
        handlers and the optimizer hook, starts the persister process of ``persist_mode =
        "process"`` (``"auto"`` starts it at the first save to disk of a large state: a job
        that never persists one does not pay for it). Idempotent."""
        if self._is_setup:
            return
        if self._closed:
            raise RuntimeError("the checkpoint manager is closed")
        self._is_setup = True
        if self._distributed:
            timeout = _td(self.config.collective_timeout_s)
            self._pg = dist.new_group(backend="gloo", timeout=timeout)
            self.consensus.pg = dist.new_group(backend="gloo", timeout=timeout)
            self._writer.pg = self._pg
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._hook = register_optimizer_step_pre_hook(self._pipeline.before_step)
        if self._install_signal_handlers:
            self.preemption.install()
        if self._pg is not None:  # rank 0 removed what a dead attempt left (constructor)
            dist.barrier(group=self._pg)
        if self._process_mode and self.config.persist_mode == "process":
            self._supervisor.start()  # asked for: ready by the first save ("auto": at it)

    def on_restore(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(step)`` after a successful restore (the worker handle sets its step)."""
        self._restore_listeners.append(fn)

    # -- public API ------------------------------------------------------------------------------
    @property
    def memory_dir(self) -> Path | None:
        """This node's memory-tier directory (None: no memory tier, or it failed)."""
        return self._pipeline.memory_dir

    @property
    def has_memory_tier(self) -> bool:
        return self.memory_dir is not None

    @property
    def num_failures(self) -> int:
        """Saves that ended without a commit so far."""
        return self._pipeline.num_failures

    @property
    def last_result(self) -> SaveResult | None:
        """The outcome of the last persisting save."""
        return self._pipeline.last_result

    def save(self, step: int, state: Mapping[str, Any], *, persist: bool = True) -> SaveResult:
        """Snapshot ``state`` as of ``step`` (the number of steps done = the step to resume
        from). Returns once training may go on; parameters and optimizer state may still be
        copying, and the next ``optimizer.step()`` waits for that. ``persist=False`` only
        refreshes the memory tier. Collective: every rank calls it with the same arguments."""
        self.setup()
        if not self._preempting:
            (preempt,) = self.consensus.agree(self.preemption.signum is not None)
            if preempt:  # a preemption notice came in: this save is the preemption save
                self._preempt_exit(step, state)
        return self._save_agreed(step, state, persist=persist)

    def _save_agreed(self, step: int, state: Mapping[str, Any], *, persist: bool) -> SaveResult:
        """``save`` once the ranks agreed there is no preemption to act on (``maybe_save``
        agrees on it together with its other flags: one all-reduce per step, not two)."""
        if persist and self._pipeline.persisting is not None:
            # a dead peer persister fails it fast (gloo sees the close); a stuck one at the deadline
            if not self._pipeline.wait_persist():
                return self._pipeline.refuse(step, "the previous save is still persisting")
        via_process = False
        if persist:
            self._start_persister()
            ready = self._check_persister()
            # "process": every save goes to the persister (the first waits for it to start);
            # "auto": the thread persists until every rank's persister is ready
            via_process = self._supervisor.proc is not None and (
                ready or self.config.persist_mode == "process"
            )
        return self._pipeline.save(
            step, state, persist=persist, via_process=via_process, marks=self._marks(step)
        )

    def _marks(self, step: int) -> dict[str, str]:
        """The manifest's record of the replicas' check (``[sdc]``) of the saved state."""
        sdc = self.sdc_hook
        if sdc is None:
            why = "one rank" if self.world_size < 2 else "the replica checks are off ([sdc])"
            return {"sdc": "unverified", "sdc_reason": why}
        return sdc.marks(step)

    def maybe_save(
        self,
        step: int,
        state: MutableMapping[str, Any],
        *,
        overlap: bool = False,
        exit_on_preemption: bool = True,
    ) -> SaveResult | None:
        """Call once per step boundary on every rank. Saves to memory / disk as configured,
        and on a preemption signal saves, waits for the commit and exits with the requeue code.
        A loss rollback (:attr:`rollback_hook`) restores into ``state``.

        The ranks agree on what to do in one small all-reduce, at every call by default.
        ``overlap=True`` is for a caller whose boundaries are ``step``, ``step + 1``, ... on
        every rank (a framework's optimizer steps): the ranks then agree only at the
        boundaries where something may be due, a snapshot or a persist of the configured
        cadence (those save at the same steps as without it) and at least every
        :data:`AGREE_EVERY_S` of training, each agreement started one step ahead and run in
        the background; a preemption notice, a loss anomaly, a finished persist or a
        time-based persist interval is acted on at the next agreement.

        ``exit_on_preemption=False`` is for a caller that stops its own loop (a framework
        integration): after the preemption save it returns None with :attr:`preempted` set
        instead of exiting."""
        if not self.config.enabled:
            return None
        self.setup()
        sdc = self.sdc_hook
        if sdc is not None and sdc.active:
            sdc.boundary(step, state)
        leave = exit_on_preemption
        if overlap:
            return self._overlapped(
                step, lambda flags, bad: self._act(step, state, flags, bad, exit_process=leave)
            )
        self.settle_agreement()
        flags, bad = self._agree(step)
        return self._act(step, state, flags, bad, exit_process=leave)

    def _local_flags(self, step: int, *, tick: bool = True) -> list[bool]:
        """This rank's view of the boundary ``step``: preempted, persist due, a persist in
        flight, its persister dead, a memory snapshot due (``tick``: this call is the step
        boundary the memory cadence measures)."""
        cadence = self.memory_cadence
        return [
            self.preemption.signum is not None,
            self.interval.due(step),
            self._pipeline.busy(),
            self._supervisor.broken(),
            self.has_memory_tier and (cadence.due(step) if tick else cadence.is_due(step)),
        ]

    def _pending_rollback(self) -> int | None:
        """The step of this rank's pending loss anomaly (None: none, or no rollback hook)."""
        hook = self.rollback_hook
        return hook.pending() if hook is not None else None

    def _agree(self, step: int, *, tick: bool = True) -> tuple[list[bool], int | None]:
        return self.consensus.agree_with_step(
            self._local_flags(step, tick=tick), self._pending_rollback()
        )

    def _overlapped(
        self, step: int, act: Callable[[list[bool], int | None], Any], *, saves: bool = True
    ) -> Any:
        """``maybe_save(overlap=True)``'s schedule: ``act`` on the flags agreed for ``step``
        at the boundaries where the ranks agree (None elsewhere). ``saves``: the caller saves
        on the agreed flags (the configured cadences set the agreements' boundaries)."""
        self.memory_cadence.tick()
        ahead, nxt = self._ahead, self._next_agreement
        result = None
        if ahead is not None and ahead.tag == step:
            self._ahead = None
            flags, bad, period = ahead.result()
            result = act(flags, bad)
            self._next_agreement = step + period
        elif ahead is not None or nxt is None or step >= nxt:
            # the first call, or boundaries that did not come as announced (every rank sees
            # the same steps): agree now, and one step ahead from here on
            self.settle_agreement()
            result = act(*self._agree(step, tick=False))
            self._next_agreement = step + 1
        if self._next_agreement == step + 1:
            self._ahead = self._start_agreement(step + 1, saves=saves)
        return result

    def _start_agreement(self, step: int, *, saves: bool = True) -> Agreement:
        """The agreement for the boundary ``step``, started at the one before it, with this
        rank's proposal of how many boundaries later the next one comes: the next snapshot
        or persist of the configured cadence, at most :data:`AGREE_EVERY_S` of training."""
        flags = self._local_flags(step, tick=False)
        cadence, every = self.memory_cadence, self.config.every_steps
        step_s = cadence.step_s
        period = 1  # until a step time is measured
        if step_s is not None and step_s > 0:
            period = min(MAX_AGREE_STEPS, max(1, int(AGREE_EVERY_S / step_s)))
        if saves and every > 0:
            period = min(period, (step // every + 1) * every - step)
        if saves and self.has_memory_tier:
            if flags[4]:  # snapshotting at ``step``: the next one counts from there
                nxt = step + cadence.every if cadence.every > 0 else None
            else:
                nxt = cadence.next_due(step)
            if nxt is not None:
                period = min(period, max(1, nxt - step))
        return self.consensus.start_agree_with_step(
            flags, self._pending_rollback(), max(1, period), tag=step
        )

    def _act(
        self,
        step: int,
        state: MutableMapping[str, Any],
        flags: list[bool],
        bad: int | None,
        *,
        exit_process: bool = True,
    ) -> SaveResult | None:
        """``maybe_save``'s decision once the ranks agreed on ``flags`` and ``bad``."""
        preempt, due, busy, broken, mem = flags
        hook = self.rollback_hook
        if bad is not None and hook is not None:  # a loss anomaly on some rank: roll back
            hook.apply(bad, step, state)
            return None
        sdc = self.sdc_hook  # the gate: saves only of state the ranks agreed on at this step
        if sdc is not None and sdc.active:
            # a save to disk or the memory tier is always checked first (the memory tier's
            # snapshot is what a restart resumes from: never one of unchecked state)
            wanted = sdc.due(step, persist=due or preempt)
            if wanted or mem:
                t0 = time.perf_counter()
                ok = sdc.check(step, state, self.consensus.pg, forced=not wanted)
                if not wanted:  # only the snapshot asked for it: part of the snapshot's cost
                    self.memory_cadence.record_forced(time.perf_counter() - t0)
                if not ok:
                    return None  # rolled back into ``state``
        if broken:  # before the skip decision: a save stuck behind a dead persister never ends
            self._check_persister()
            busy = False
        if preempt:
            self._preempt_exit(step, state, exit_process=exit_process)
            return None
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

    def preemption_agreed(self, step: int | None = None) -> bool:
        """Collective: True on every rank when a preemption notice reached any rank (for a
        caller that does not save through ``maybe_save``). With ``step`` (the boundary:
        ``step``, ``step + 1``, ... on every rank) the ranks agree on the schedule of
        ``maybe_save(overlap=True)``, False in between."""
        if step is None:
            self.settle_agreement()
            (preempt,) = self.consensus.agree(self.preemption.signum is not None)
            return preempt
        return bool(self._overlapped(step, lambda flags, bad: flags[0], saves=False))

    def settle_agreement(self) -> None:
        """Read the agreement ``maybe_save(overlap=True)`` left running (local; its flags are
        dropped): before the training loop ends or the caller stops calling it."""
        ahead, self._ahead = self._ahead, None
        self._next_agreement = None
        if ahead is not None:
            ahead.result()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for staging and the persist in flight; True if the last persist committed."""
        return self._pipeline.wait(timeout)

    def wait_staged(self) -> None:
        """Block until the last save's copy is complete (``optimizer.step()`` calls this)."""
        self._pipeline.wait_staged()

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
        if step is not None and max_step is None and min_step is None:
            self._persist_owed(step, state)
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

    def _persist_owed(self, step: int, state: Mapping[str, Any]) -> None:
        """Collective, after a restore of ``step``: a restart from the memory tier can resume
        from a snapshot newer than the disk's newest checkpoint. Where a persist of the step
        cadence was due at or before ``step`` and never committed (the worker died while it
        was in flight), the restored state is persisted now: the disk keeps its cadence (a
        restart from disk redoes at most one interval)."""
        every = self.config.every_steps
        if not self.config.enabled or every <= 0 or step < every:
            return
        owed = False
        if self.rank == 0:  # one rank's listing: the same answer on every rank
            committed = mf.committed_steps(self.storage, self.root)
            owed = not committed or committed[-1] < step // every * every
        (owed,) = self.consensus.agree(owed)
        if owed:
            logger.info("persisting the restored step %d (the disk's last due save is missing)",
                        step)  # fmt: skip
            self._save_agreed(step, state, persist=True)

    def discard_snapshots_after(self, step: int) -> None:
        """Drop this rank's memory-tier snapshots of steps after ``step`` (after a rollback
        they belong to the abandoned timeline; a restore must never pick them)."""
        self._pipeline.discard_after(step)

    def interval_s(self) -> float | None:
        """The automatic interval in seconds (the planner's), or None when not in auto mode."""
        return self.interval.interval_s

    def set_mtbf(self, mtbf_s: float) -> None:
        """Observed mean time between failures (the runtime feeds it; auto interval uses it)."""
        self.interval.set_mtbf(mtbf_s)

    def close(self) -> None:
        """Wait for work in flight, then release threads, hooks and buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.settle_agreement()
            self.wait()
        except Exception:
            logger.exception("checkpoint work in flight failed at close")
        if self._hook is not None:
            self._hook.remove()
        self.preemption.restore()
        self._pipeline.stop_threads()
        self._supervisor.close()
        self._pipeline.release()
        if self._private_dir is not None:
            import shutil

            shutil.rmtree(self._private_dir, ignore_errors=True)
        if self._private_lock is not None:
            os.close(self._private_lock)
            self._private_lock = None

    # -- persister supervision -------------------------------------------------------------------
    def _start_persister(self) -> None:
        """Collective: start the persister processes at the first save to disk, and with
        ``persist_mode = "auto"`` only once some rank stages :data:`AUTO_PROCESS_MIN_BYTES`
        or more (below that, the persist thread's time on the interpreter is a fraction of a
        millisecond, less than what a persister process costs to start)."""
        if self._supervisor.started or self._no_persister:
            return
        if self.config.persist_mode == "process":
            if self._process_mode:
                self._supervisor.start()
            return
        if self.config.persist_mode != "auto":
            return
        # the persisters form one group: all ranks start theirs, or none does
        big, unusable = self.consensus.agree(
            self._pipeline.staged_bytes >= AUTO_PROCESS_MIN_BYTES, not self._process_mode
        )
        if unusable:
            self._no_persister = True
            return
        if big:
            if self.memory_dir is None and self._private_dir is None:
                # the persister maps the staged slots: from now on they are shared memory
                from trainguard.checkpoint import persist_proc

                self._pipeline.wait_staged()
                self._private_dir, self._private_lock = persist_proc.private_staging_dir(
                    self.config.memory_root
                )
                self._supervisor.cleanup_dir = self._private_dir
                self._pipeline.stage_into(self._private_dir)
            self._supervisor.start()

    def _check_persister(self) -> bool:
        """Collective (process mode): replace the persisters when any rank's died
        (:meth:`PersisterSupervisor.check`); whether every rank's persister is ready."""
        return self._supervisor.check(settle=self._after_persisters_killed)

    def _after_persisters_killed(self) -> None:
        """Every rank killed its persister: the save in flight ends (failed), no rank's old
        persister is still writing, rank 0 removes what they left uncommitted."""
        if self._pipeline.persisting is not None:
            self._pipeline.persisting.done.wait(self._pipeline.persist_wait_s())
        self.consensus.barrier()
        self._remove_uncommitted()
        if self._pg is not None:
            dist.barrier(group=self._pg)

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

    # -- interval, cadence, preemption -----------------------------------------------------------
    def _interval_changed(self, tau: float, stall: float, mtbf: float) -> None:
        self._metric(checkpoint_interval_s=tau)
        if self.rank == 0:
            self._emit("checkpoint_interval", interval_s=round(tau, 3), stall_s=stall, mtbf_s=mtbf)
        logger.info("checkpoint interval %.1f s (stall %.3f s, MTBF %.0f s)", tau, stall, mtbf)

    def record_step_overhead(self, seconds: float) -> None:
        """trainguard's whole time on the training thread in one step, snapshot included (a
        framework integration's hooks, reported once per step after ``maybe_save``): the
        memory tier's cadence then keeps all of it within ``memory_max_stall_fraction``."""
        self.memory_cadence.record_overhead(seconds)

    def _memory_cadence_changed(self, every: int, stall: float, step: float) -> None:
        fixed = self.memory_cadence.fixed_s
        logger.info(
            "memory tier every %d steps (stall %.4f s, step %.4f s, fixed cost %s s, "
            "at most %g of training)",
            every,
            stall,
            step,
            "unmeasured" if fixed is None else f"{fixed:.6f}",
            self.memory_cadence.max_fraction,
        )
        if self.rank == 0:
            self._emit(
                "checkpoint_memory_cadence",
                every_steps=every,
                stall_s=round(stall, 6),
                step_s=round(step, 6),
                fixed_s=None if fixed is None else round(fixed, 6),
                max_stall_fraction=self.memory_cadence.max_fraction,
            )

    def _preempt_exit(
        self, step: int, state: Mapping[str, Any], *, exit_process: bool = True
    ) -> None:
        self._preempting = True
        if self.rank == 0:
            self._emit("checkpoint_preempted", step=step, signal=self.preemption.name)
        result = self.save(step, state, persist=True)
        ok = result.wait(self._pipeline.persist_wait_s())
        self.preemption.committed = ok
        if self.rank == 0:
            self._emit("checkpoint_preempt_saved", step=step, committed=ok, error=result.error)
        self.close()
        self.preempted = True
        if exit_process:
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
