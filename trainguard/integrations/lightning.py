"""trainguard for PyTorch Lightning (``lightning.pytorch`` or ``pytorch_lightning``). Tested
with Lightning 2.6.

    from trainguard.integrations.lightning import TrainGuardCallback
    trainer = L.Trainer(..., callbacks=[TrainGuardCallback()])

What it does, on every rank:

- a step heartbeat per optimizer step (``tg.step`` from the step's first batch start to the
  batch end that advanced ``trainer.global_step``): hang and straggler detection, step time,
  tokens/s and FLOPs where the batch has ``input_ids`` (else samples/s);
- every value in ``trainer.callback_metrics`` (each rank's own: Lightning does not reduce
  them unless ``sync_dist``) and the learning rate through ``tg.log``, with the metric
  contract's names where one exists (``train_loss``, ``train/loss_step`` → ``loss``), at
  every step end, at most 10 times a second (``METRICS_MIN_INTERVAL_S``);
- a snapshot of module, optimizer, scheduler, RNG and step into trainguard's checkpoint
  manager on the memory tier's cadence (the node's memory tier under ``trainguard run``;
  ``maybe_save(overlap=True)``: the ranks agree in the background, not at every step); at
  ``on_train_start`` a restore from it when it holds a newer step of the same epoch than the
  checkpoint Lightning resumed from, the loop's progress counters moved on to it. The data
  loader restarts the epoch as Lightning's own mid-epoch resume does (a non-stateful loader
  has no position to restore);
- a preemption notice (SIGTERM / SIGUSR1): trainguard's preemption save, then Lightning's
  ``last`` checkpoint (``trainer.save_checkpoint`` into the ``ModelCheckpoint`` directory),
  ``trainer.should_stop``, and the process exits with the requeue code 75.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from trainguard.core.failures import REQUEUE_EXIT_CODE
from trainguard.integrations._frameworks import check_version, guarded
from trainguard.integrations.common import (
    MetricMapper,
    SafeTelemetry,
    StepBeat,
    batch_amounts,
    flops_per_token,
    report_overhead,
)

__all__ = ["TrainGuardCallback", "callback_class"]

logger = logging.getLogger(__name__)

METRICS_MIN_INTERVAL_S = 0.1
"""The metrics are recorded at a step end at most this often (10 times a second): at every
step of a step longer than that. Reading them (``trainer.callback_metrics`` is recomputed on
each access, a tensor's ``.item()``) costs tens of microseconds, a share of a short step."""


def _lightning() -> Any:
    if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
        import pytorch_lightning as pl

        return pl
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    return pl


def _bump(progress: Any, n: int) -> None:
    """Move a Lightning progress tracker (``total`` and ``current``: ready, started,
    processed, completed) on by ``n``."""
    for part in ("total", "current"):
        tracker = getattr(progress, part, None)
        for name in ("ready", "started", "processed", "completed"):
            if tracker is not None and hasattr(tracker, name):
                setattr(tracker, name, getattr(tracker, name) + n)


class _Mixin:
    """The callback's body; :func:`callback_class` puts it on a Lightning ``Callback``."""

    def __init__(self, *, resume: bool = True) -> None:
        self.resume = resume
        self._tg: Any = None
        self._t: SafeTelemetry | None = None
        self._beat: StepBeat | None = None
        self._mapper = MetricMapper(strip_prefixes=True)
        self._ckpt: Any = None
        self._state: dict[str, Any] = {}
        self._fpt: float | None = None
        self._next_log = 0.0  # monotonic time of the next metrics record
        self._spent = 0.0  # this step's time in the hooks so far
        self.resumed_step: int | None = None
        """The step restored from trainguard's snapshot at ``on_train_start``, or None."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        import trainguard

        self._tg = tg = trainguard.init()
        self._t = SafeTelemetry(tg, "lightning")
        self._beat = StepBeat(self._t)
        self._ckpt = tg.checkpoint
        check_version("lightning")
        opts = list(trainer.optimizers)
        restored = False
        if self.resume and len(opts) == 1 and pl_module.automatic_optimization:
            self._state = {"model": pl_module, "optim": opts[0]}
            scheds = [c.scheduler for c in trainer.lr_scheduler_configs]
            if len(scheds) == 1:
                self._state["sched"] = scheds[0]
            restored, _ = guarded(tg, "lightning", "restoring trainguard's snapshot",
                                  lambda: self._restore(trainer))  # fmt: skip
            if not restored:  # resume off: no snapshots from here on
                self._state = {}
                self.resumed_step = None
        if not restored:
            self._ckpt.setup()  # the preemption handlers (collective: every rank is here)
        if tg.rank == 0:
            tg.events.emit(
                "integration_attached",
                framework="lightning",
                resume=bool(self._state),
                resumed_step=self.resumed_step,
            )

    def _restore(self, trainer: Any) -> None:
        done = int(trainer.global_step)
        accum = max(1, int(trainer.accumulate_grad_batches))
        per_epoch = None
        batches = trainer.num_training_batches
        if isinstance(batches, int) and batches > 0:
            per_epoch = max(1, batches // accum)
        newest = None if per_epoch is None else (done // per_epoch + 1) * per_epoch - 1
        if trainer.max_steps and trainer.max_steps > 0:
            newest = trainer.max_steps if newest is None else min(newest, trainer.max_steps)
        step = self._ckpt.restore(self._state, min_step=done + 1, max_step=newest)
        if step is None or step <= done:
            return
        delta = step - done
        loop = trainer.fit_loop.epoch_loop
        _bump(loop.batch_progress, delta * accum)
        _bump(loop.automatic_optimization.optim_progress.optimizer.step, delta)
        _bump(loop.automatic_optimization.optim_progress.optimizer.zero_grad, delta)
        _bump(loop.scheduler_progress, delta)
        loop._batches_that_stepped += delta
        self.resumed_step = step
        if self._tg.rank == 0:
            print(
                f"trainguard: resumed at step {step} from its snapshot "
                f"(the framework's checkpoint had step {done})",
                file=sys.stderr,
                flush=True,
            )

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._beat is None or self._beat.open:
            return
        t0 = time.perf_counter()
        if self._spent:  # the last step's hooks
            report_overhead(self._t, self._ckpt, self._spent)
            self._spent = 0.0
        try:
            tokens, samples, seq = batch_amounts([batch])
        except Exception:
            tokens = samples = seq = None
        flops = None
        if tokens:
            if self._fpt is None:
                self._fpt = flops_per_token(pl_module, seq)
            flops = self._fpt * tokens if self._fpt else None
        self._beat.begin(int(trainer.global_step), tokens=tokens, samples=samples, flops=flops)
        self._spent += time.perf_counter() - t0

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        beat = self._beat
        if beat is None or not beat.open or beat.step is None:
            return
        step = int(trainer.global_step)
        if step <= beat.step:  # gradient accumulation: the optimizer has not stepped yet
            return
        t0 = time.perf_counter()
        try:
            self._step_end(trainer, outputs, step)
        finally:
            self._spent += time.perf_counter() - t0

    def _step_end(self, trainer: Any, outputs: Any, step: int) -> None:
        assert self._beat is not None
        self._beat.end()
        self._log(trainer, outputs, step)
        if self._ckpt is None:
            return
        try:
            if self._state:  # the ranks' agreement for the next step runs during it
                self._ckpt.maybe_save(step, self._state, overlap=True)
            elif self._ckpt.preemption_agreed(step):
                raise SystemExit(REQUEUE_EXIT_CODE)
        except SystemExit as e:
            if e.code != REQUEUE_EXIT_CODE:
                raise
            self._preempt(trainer, step)

    def _log(self, trainer: Any, outputs: Any, step: int) -> None:
        assert self._t is not None
        now = time.monotonic()
        if now < self._next_log:
            return
        self._next_log = now + METRICS_MIN_INTERVAL_S
        try:
            values: dict[str, Any] = dict(trainer.callback_metrics)
            keys = self._mapper.keys_of(tuple(values))
            if "loss" not in keys:
                loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
                if loss is not None:
                    values["loss"] = loss
            if "lr" not in keys:
                opts = trainer.optimizers
                if opts:
                    values["lr"] = opts[0].param_groups[0]["lr"]
            metrics = self._mapper.map(values)
        except Exception:
            self._t.failed("mapping metrics")
            return
        self._t.log(step, metrics)

    def _preempt(self, trainer: Any, step: int) -> None:
        trainer.should_stop = True
        tg = self._tg
        if tg.rank == 0:
            tg.events.emit("integration_preempted", framework="lightning", step=step)
        cb = getattr(trainer, "checkpoint_callback", None)
        dirpath = getattr(cb, "dirpath", None)
        if dirpath:
            name = getattr(cb, "CHECKPOINT_NAME_LAST", "last") + getattr(
                cb, "FILE_EXTENSION", ".ckpt"
            )
            trainer.save_checkpoint(os.path.join(dirpath, name))  # every rank (collective)
        print(
            "trainguard: preempted; the framework saved its checkpoint, exiting with "
            f"{REQUEUE_EXIT_CODE} (requeue)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(REQUEUE_EXIT_CODE)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._beat is not None:
            self._beat.end()
            self._tg.training_done()  # a final save or a slow exit is not a hang
        if self._ckpt is not None:
            try:
                self._ckpt.settle_agreement()
                self._ckpt.wait()
            except Exception:
                logger.exception("trainguard snapshot in flight failed")


_classes: dict[Any, type] = {}


def callback_class(base: Any = None) -> type:
    """The callback class for a Lightning ``Callback`` base (default: the installed
    ``lightning.pytorch``, else ``pytorch_lightning``; a trainer of one package accepts only
    its own callbacks)."""
    if base is None:
        base = _lightning().Callback
    cls = _classes.get(base)
    if cls is None:
        cls = _classes[base] = type("TrainGuardCallback", (_Mixin, base), {"__doc__": __doc__})
        cls.__module__ = __name__
    return cls


TrainGuardCallback = callback_class()
"""The callback for the installed Lightning (``lightning.pytorch``, else ``pytorch_lightning``)."""
