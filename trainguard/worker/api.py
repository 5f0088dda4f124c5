"""The worker-side handle: ``tg = trainguard.init()``.

Works under ``trainguard run`` (heartbeats and step progress reach the agent), under plain
``torchrun`` and under plain ``python`` (no agent: heartbeats are no-ops, metrics and events
still go to a run directory).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainguard.chaos.faults import WorkerChaos
from trainguard.core.atomicfile import make_dirs, open_append
from trainguard.core.config import (
    ConfigError,
    load_worker_section,
    setting_env,
    worker_section_or_default,
)
from trainguard.core.config.fleet import FleetConfig
from trainguard.core.config.telemetry import TelemetryConfig
from trainguard.core.contracts import envvars
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import EventLog
from trainguard.core.failures import peer_failure
from trainguard.core.procs import exit_now, release_worker_gc
from trainguard.core.progress import ProgressWriter, progress_path
from trainguard.telemetry.spans import TRACEPARENT_ENV, SpanRecorder
from trainguard.worker.sniff import SniffRunner

if TYPE_CHECKING:
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.worker.rollback import LossGuard
    from trainguard.worker.sdc import SdcGuard

__all__ = ["RESERVED_LOG_KEYS", "TrainGuard", "init"]

logger = logging.getLogger(__name__)

_PLAIN = frozenset({float, int, str})

RESERVED_LOG_KEYS = frozenset({"time", "kind", "rank", "attempt"})
"""Keys of every metrics record that ``tg.log(**metrics)`` may not overwrite (``step`` is its
own keyword argument)."""

_handle: TrainGuard | None = None
_handle_lock = threading.Lock()


def _default_run_dir() -> Path:
    explicit = envvars.run_dir() or os.environ.get(setting_env("runtime", "run_dir"))
    if explicit:
        return Path(explicit)
    root = os.environ.get(setting_env("runtime", "runs_root"), "trainguard-runs")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        run_id = time.strftime("local-%Y%m%d-%H%M%S-") + str(os.getpid())
    return Path(root) / run_id


def _record_error(exc: BaseException) -> None:
    """Write ``exc`` to this worker's error file (``TORCHELASTIC_ERROR_FILE``) with torch's
    ``ErrorHandler``, which takes the traceback of the exception being handled."""
    from trainguard.core._torch import record_error_file

    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - re-raised only to be the one being handled
        try:
            record_error_file(e)
        except OSError as err:
            logger.warning("trainguard: cannot write the error file: %s", err)


class TrainGuard:
    """Handle returned by :func:`init`. One per worker process.

    Attributes mirror torchrun's env contract: ``rank``, ``local_rank``, ``world_size``,
    ``local_world_size``; plus two restart counters with one meaning each: ``attempt``, the
    job-wide worker-group attempt (0-based, the same on every node, in every event and
    record), and ``agent_restarts``, torch's per-agent ``TORCHELASTIC_RESTART_COUNT``; and
    ``run_dir``, ``step_num`` (the one step counter).
    """

    def __init__(self, *, run_dir: str | os.PathLike[str] | None = None) -> None:
        env = os.environ
        self.rank = int(env.get("RANK", "0"))
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.world_size = int(env.get("WORLD_SIZE", "1"))
        self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", "1"))
        self.agent_restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.attempt = int(env.get(envvars.ATTEMPT, str(self.agent_restarts)))
        self.node = env.get(envvars.NODE) or env.get("SLURMD_NODENAME") or socket.gethostname()
        self.under_agent = envvars.PROGRESS_DIR in env
        self.run_dir = Path(run_dir) if run_dir is not None else _default_run_dir()
        make_dirs(self.run_dir)  # private (0700) when this worker is the first to make it
        if self.under_agent:  # the agent's resolved config must be readable (ConfigError)
            load_worker_section(self.run_dir, "runtime")
        if self.world_size > 1:
            self._install_excepthook()
        self.events = EventLog(self.run_dir, node=self.node, context=self._event_context)
        self.generation = 0
        """In-process generation (``trainguard.run``): 0, +1 per in-process restart."""
        self.in_process = False
        """The training runs in ``trainguard.run`` with in-process restarts."""
        self._step_guard: Callable[[], None] | None = None  # trainguard.run's restart check
        self._chaos = WorkerChaos.from_env(rank=self.rank, attempt=self.attempt, node=self.node)
        """Injected faults (``TRAINGUARD_CHAOS``, trainguard.chaos.faults); None when unset."""
        if self._chaos is not None:
            armed = [f.describe() for f in self._chaos.faults]
            logger.warning("rank %d: injected faults armed: %s", self.rank, "; ".join(armed))
            self.events.emit("chaos_armed", faults=armed)
        self.step_num = 0
        """The number of the next step ``step()`` will run = the steps done so far. ``step()``
        advances it; a checkpoint restore (``tg.checkpoint.restore_or_init``) sets it."""
        self._checkpoint: Any = None
        self._metrics_lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self.flush_cpu_s = 0.0
        """CPU time the metrics flusher thread has spent writing this process's records."""
        self._metrics_fd: int | None = None
        self._flusher: threading.Thread | None = None
        self._flush_stop = threading.Event()
        self._flush_hooks = False
        self._closed = False
        # telemetry settings never stop a worker: a bad value → the defaults and a warning
        self._telemetry: TelemetryConfig = worker_section_or_default(self.run_dir, "telemetry")
        self._spans = SpanRecorder(
            self._write_record,
            traceparent=env.get(TRACEPARENT_ENV),
            every_n_steps=self._telemetry.trace_every_n_steps,
            base={"rank": self.rank, "attempt": self.attempt},
        )
        self._flops_per_step: float | None = None
        self._device: str | None = None
        self._cuda_available: bool | None = None
        self._current_step: int | None = None  # the step the next tg.log values belong to
        self._rollback, self._sdc = self._make_rollback(), self._make_sdc()
        self._sniff = self._make_sniff()
        self._progress: ProgressWriter | None = None
        if self.under_agent:
            self._report_to_agent(env[envvars.PROGRESS_DIR])

    def _report_to_agent(self, progress_dir: str) -> None:
        """The progress file the agent watches, and the stack dump it can ask for."""
        interval = load_worker_section(self.run_dir, "runtime").heartbeat_interval_s
        self._progress = ProgressWriter(
            progress_path(progress_dir, self.rank), heartbeat_interval_s=interval
        )
        from trainguard.health.stacks import register_stack_dump

        self._stack_file = register_stack_dump(self.run_dir, self.rank, self.attempt)

    def _make_sniff(self) -> SniffRunner | None:
        """Sniff tests (``[fleet] sniff_interval_s``), run from ``step()``; under an agent only."""
        if not self.under_agent:
            return None
        cfg: FleetConfig = worker_section_or_default(self.run_dir, "fleet")
        if not cfg.enabled or cfg.sniff_interval_s <= 0:
            return None
        return SniffRunner(cfg, rank=self.rank, write=self._write_record,
                           base={"attempt": self.attempt, "node": self.node})  # fmt: skip

    def _make_rollback(self) -> LossGuard | None:
        cfg = load_worker_section(self.run_dir, "rollback")
        if not cfg.enabled:
            return None
        from trainguard.worker.rollback import LossGuard

        guard = LossGuard(self, cfg)
        self.step_num = guard.ledger.next_step(self.step_num)
        return guard

    def _make_sdc(self) -> SdcGuard | None:
        """Silent-data-corruption checks (``[sdc]``): with more than one rank."""
        cfg = load_worker_section(self.run_dir, "sdc")
        if not cfg.enabled or self.world_size < 2:
            return None
        from trainguard.worker.sdc import SdcGuard

        return SdcGuard(self, cfg)

    @property
    def skip_ranges(self) -> list[tuple[int, int]]:
        """Step windows (first, last; inclusive) skipped after loss rollbacks. ``tg.step_num``
        already jumps over them (``step()`` and a restore move it past a window); a loop with
        its own step counter asks :meth:`should_skip`."""
        return list(self._rollback.ledger.windows) if self._rollback is not None else []

    def should_skip(self, step: int | None = None) -> bool:
        """True if the data of ``step`` (default ``tg.step_num``) is in a skipped window."""
        if self._rollback is None:
            return False
        return self._rollback.ledger.should_skip(self.step_num if step is None else step)

    def _after_restore(self, step: int) -> None:
        if self._rollback is not None:
            self.step_num = self._rollback.ledger.next_step(step)

    def _armed_chaos(self) -> WorkerChaos | None:
        # Injected faults fire in the first in-process generation only: a replacement process
        # (same environment, same attempt) or a survivor re-entering trainguard.run would
        # otherwise meet the same "kill at step s" again.
        return self._chaos if self.generation == 0 else None

    def _install_excepthook(self) -> None:
        """A survivor's collective that failed because a peer rank died is a consequence, not
        a failure: one line instead of a traceback and exit 1 (other errors keep theirs)."""
        previous = sys.excepthook

        def hook(exc_type: Any, exc: Any, tb: Any) -> None:
            peer = peer_failure(exc) if isinstance(exc, BaseException) else None
            if peer is None:
                previous(exc_type, exc, tb)
                return
            print(
                f"rank {self.rank}: stopped after {self.step_num} steps: a peer rank failed ({peer})",
                file=sys.stderr,
                flush=True,
            )
            # torch's error file says what stopped this rank: the agent reads a consequence
            # there, and names the peer's failure the root cause even when both are seen in
            # the same second
            _record_error(exc)
            # exit 1 as the interpreter would, without its teardown: the broken process
            # group's threads can abort it there (SIGABRT, exit -6)
            exit_now(1)

        sys.excepthook = hook

    # -- context -----------------------------------------------------------------------------
    def _event_context(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "rank": self.rank}

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def checkpoint(self) -> CheckpointManager:
        """The :class:`trainguard.checkpoint.CheckpointManager` of this worker, created on
        first access. Local: touching it runs no collective and installs nothing, so any
        rank may. The collective step is ``tg.checkpoint.setup()``, which ``restore``,
        ``restore_or_init``, ``save`` and ``maybe_save`` (called on every rank) run first."""
        if self._checkpoint is None:
            from trainguard.checkpoint.manager import for_worker

            self._checkpoint = for_worker(self)
            self._checkpoint.on_restore(self._after_restore)
            self._checkpoint.rollback_hook = self._rollback
            self._checkpoint.sdc_hook = self._sdc
            if self._sdc is not None:
                self._checkpoint.on_restore(self._sdc.restored)
        return self._checkpoint

    def ft_wrap(self, model: Any, optimizer: Any, **kwargs: Any) -> Any:
        """torchft mode (``trainguard run --ft``): this process joins its replica group's
        ``torchft.Manager``; returns :class:`trainguard.ft.worker.FTRun` (``.model``,
        ``.optimizer``, ``.manager``, ``current_step()``)."""
        from trainguard.ft.worker import wrap

        run = wrap(model, optimizer, tg=self, **kwargs)
        self.__dict__["_ft"] = run
        return run

    # -- metrics -----------------------------------------------------------------------------
    def _write_record(self, record: dict[str, Any]) -> None:
        with self._metrics_lock:
            self._pending.append(record)
            n = len(self._pending)
            if self._flusher is None and not self._closed:
                self._start_flusher()
        if n >= 1000:
            self._flush_metrics()

    # Records are serialised and appended to ``metrics/rank_<r>.jsonl`` by a daemon thread
    # every ``[telemetry] flush_interval_s`` (0.2 s), not by the training thread: once
    # per step, with cold caches, json.dumps + write cost ~100 us, a list append ~1 us. A
    # SIGKILL loses at most one interval of records; exit, close() and fork are handled.
    def _start_flusher(self) -> None:
        import atexit
        import weakref

        interval = self._telemetry.flush_interval_s
        ref = weakref.ref(self)
        stop = self._flush_stop

        def loop() -> None:
            while not stop.wait(interval):
                me = ref()
                if me is None:
                    return
                c0 = time.thread_time()
                me._flush_metrics()
                me.flush_cpu_s += time.thread_time() - c0
                del me

        self._flusher = threading.Thread(target=loop, name="tg-metrics-flush", daemon=True)
        self._flusher.start()
        if not self._flush_hooks:
            self._flush_hooks = True

            def flush_at_exit() -> None:
                if (me := ref()) is not None:
                    me._flush_metrics()

            def forked() -> None:
                if (me := ref()) is not None:
                    me._forked()

            atexit.register(flush_at_exit)
            os.register_at_fork(after_in_child=forked)

    def _forked(self) -> None:
        # the parent flushes its own records; a forked child (e.g. a DataLoader worker)
        # starts empty and gets its own flusher if it logs
        self._metrics_lock = threading.Lock()
        self._pending = []
        self._flusher = None
        self._flush_stop = threading.Event()
        self._metrics_fd = None

    def _flush_metrics(self) -> None:
        with self._metrics_lock:
            if not self._pending:
                return
            records, self._pending = self._pending, []
            data = "".join(
                json.dumps(r, separators=(",", ":"), default=str) + "\n" for r in records
            ).encode()
            try:
                if self._metrics_fd is None:
                    path = RunDir(self.run_dir).metrics(self.rank)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    self._metrics_fd = open_append(path)
                view = memoryview(data)
                while view:
                    view = view[os.write(self._metrics_fd, view) :]
            except OSError as e:
                logger.warning("could not write metrics to %s: %s", self.run_dir, e)

    def log(self, *, step: int | None = None, **metrics: float | int | str) -> None:
        """Record named values (``loss=``, ``reward=``, ``kl=``...) for the current step.

        The record's own keys (``time``, ``kind``, ``rank``, ``attempt``, ``step``) cannot be
        metric names: ValueError."""
        reserved = RESERVED_LOG_KEYS.intersection(metrics)
        if reserved:
            names = ", ".join(sorted(reserved))
            raise ValueError(
                f"tg.log({names}=...): {names} is reserved for the record's own fields "
                f"({', '.join(sorted(RESERVED_LOG_KEYS))}, and step=, the step number); "
                f"rename the metric, e.g. {sorted(reserved)[0]}_value="
            )
        if (chaos := self._armed_chaos()) is not None:
            chaos.step_begin(self.step_num if step is None else step)
        record: dict[str, Any] = {
            "time": time.time(),
            "kind": "log",
            "rank": self.rank,
            "attempt": self.attempt,
            "step": self.step_num if step is None else step,
        }
        for k, v in metrics.items():
            record[k] = v if type(v) in _PLAIN else v.item() if hasattr(v, "item") else v
        if self._rollback is not None and self._current_step is not None:
            self._rollback.observe(self._current_step, record)
        if self._sdc is not None and self._current_step is not None:
            self._sdc.observe(self._current_step, record)
        self._write_record(record)

    @contextmanager
    def step(
        self,
        step: int | None = None,
        *,
        tokens: int | None = None,
        samples: int | None = None,
        flops: float | Literal["auto"] | None = None,
    ) -> Iterator[int]:
        """Time one training step and report progress to the agent.

        Yields the step number. ``tokens``/``samples``/``flops`` are per-rank amounts processed
        in this step; they feed throughput and MFU. ``flops="auto"`` counts the first step's
        FLOPs with ``torch.utils.flop_counter`` and reuses the count for later steps.
        """
        if self._step_guard is not None:
            self._step_guard()
        num = self.step_num if step is None else step
        self._current_step = num
        if self._progress is not None:
            self._progress.step_begin(num)
        if (chaos := self._armed_chaos()) is not None:
            chaos.step_begin(num)
        span_id, span_start = self._spans.begin_step(num)
        counter = None
        if flops == "auto" and self._flops_per_step is None:
            from torch.utils.flop_counter import FlopCounterMode

            counter = FlopCounterMode(display=False)
            counter.__enter__()
        t0 = time.perf_counter()
        failed = False
        try:
            yield num
            if (chaos := self._armed_chaos()) is not None:
                chaos.step_body_done(num, time.perf_counter() - t0)
        except BaseException:
            failed = True  # recorded as a failed step (not progress), then re-raised
            raise
        finally:
            # set-up is over: the collector held off since start-up runs again, its one full
            # collection inside the first step's time (where the script's own timing has it)
            release_worker_gc()
            dt = time.perf_counter() - t0
            if counter is not None:
                counter.__exit__(None, None, None)
                if not failed:
                    self._flops_per_step = float(counter.get_total_flops())
            if flops == "auto":
                flops = self._flops_per_step
            if self._progress is not None:
                self._progress.step_end(num, dt)
            self.step_num = num + 1
            if self._rollback is not None:  # the next data position: past a skipped window
                self.step_num = self._rollback.ledger.next_step(num + 1)
            self._write_record(self._step_record(num, dt, tokens, samples, flops, failed))
            self._spans.end_step(num, span_id, span_start, failed=failed)
            if self._sniff is not None and not failed:
                self._sniff.after_step(num, self.generation)

    def _step_record(
        self,
        num: int,
        dt: float,
        tokens: int | None,
        samples: int | None,
        flops: float | None,
        failed: bool,
    ) -> dict[str, Any]:
        """The ``step`` record of step ``num`` (``dt`` seconds; the amounts given)."""
        record: dict[str, Any] = {
            "time": time.time(),
            "kind": "step",
            "rank": self.rank,
            "attempt": self.attempt,
            "step": num,
            "step_time_s": dt,
        }
        if tokens is not None:
            record["tokens"] = tokens
        if samples is not None:
            record["samples"] = samples
        if flops is not None:
            record["flops"] = flops
        if failed:
            record["failed"] = True
        spans = self._spans.take_durations()
        if spans:
            record["spans"] = spans
        self._add_device_info(record)
        return record

    def span(self, name: str, **attributes: object) -> Any:
        """``with tg.span("rollout"):`` times a block; a child span of the current step
        (recorded when the step is sampled, its duration always summed into the step record)."""
        return self._spans.span(name, **attributes)

    def _add_device_info(self, record: dict[str, Any]) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and self._cuda_available is None:
            self._cuda_available = bool(torch.cuda.is_available())  # asked once: not cheap
        cuda = torch is not None and self._cuda_available and torch.cuda.is_initialized()
        if self._device is None:
            self._device = torch.cuda.get_device_name() if torch is not None and cuda else "cpu"
            record["device"] = self._device
        if torch is not None and cuda:
            record["gpu_memory_bytes"] = torch.cuda.memory_allocated()
            record["gpu_memory_peak_bytes"] = torch.cuda.max_memory_allocated()

    def training_done(self) -> None:
        """The training loop has ended (a framework's train-end hook): no more step
        heartbeats. What the process does next (a final save, evaluation, exit) gets hang
        detection's idle timeout, as after ``close()``; metrics and checkpoints still work."""
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    def close(self) -> None:
        """Flush and release resources; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.__dict__.get("_ft") is not None:
            self.__dict__["_ft"].close()
        if self._checkpoint is not None:
            self._checkpoint.close()
        if self._progress is not None:
            self._progress.close()
        self._flush_stop.set()
        self._flush_metrics()
        with self._metrics_lock:
            if self._metrics_fd is not None:
                os.close(self._metrics_fd)
                self._metrics_fd = None


def init(*, run_dir: str | os.PathLike[str] | None = None) -> TrainGuard:
    """The worker handle of this process: created by the first call, returned again by the
    next ones (until it is closed). A later call asking for another ``run_dir`` is an error."""
    global _handle
    with _handle_lock:
        tg = _handle
        if tg is not None and not tg._closed:
            if run_dir is not None and Path(run_dir).resolve() != tg.run_dir.resolve():
                raise ValueError(
                    f"trainguard.init(run_dir={str(run_dir)!r}): this process's handle already "
                    f"writes to {tg.run_dir}; call init() without run_dir, or close() it first"
                )
            return tg
        try:
            _handle = TrainGuard(run_dir=run_dir)
        except ConfigError as e:
            print(f"trainguard.init(): {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        return _handle
