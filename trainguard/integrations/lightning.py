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
from typing import TYPE_CHECKING, Any

from trainguard.integrations.adapter import FrameworkAdapter
from trainguard.integrations.common import (
    MetricMapper,
    batch_amounts,
    flops_per_token,
    report_overhead,
)

__all__ = ["TrainGuardCallback", "callback_class"]

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

logger = logging.getLogger(__name__)

METRICS_MIN_INTERVAL_S = 0.1
"""The metrics are recorded at a step end at most this often (10 times a second): at every
step of a step longer than that. Reading them (``trainer.callback_metrics`` is recomputed on
each access, a tensor's ``.item()``) costs tens of microseconds, a share of a short step."""


def _lightning() -> Any:
    if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
        import pytorch_lightning

        return pytorch_lightning
    try:
        import lightning.pytorch

        return lightning.pytorch
    except ImportError:
        import pytorch_lightning

        return pytorch_lightning


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
        self._a = FrameworkAdapter("lightning", "lightning", resume=resume)
        self._mapper = MetricMapper(strip_prefixes=True)
        self._fpt: float | None = None
        self._next_log = 0.0  # monotonic time of the next metrics record
        self._spent = 0.0  # this step's time in the hooks so far

    @property
    def resume(self) -> bool:
        return self._a.resume

    @property
    def resumed_step(self) -> int | None:
        """The step restored from trainguard's snapshot at ``on_train_start``, or None."""
        return self._a.resumed_step

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        a = self._a
        a.start()
        opts = list(trainer.optimizers)
        snapshot: dict[str, Any] = {}
        if len(opts) == 1 and pl_module.automatic_optimization:
            snapshot = {"model": pl_module, "optim": opts[0]}
            scheds = [c.scheduler for c in trainer.lr_scheduler_configs]
            if len(scheds) == 1:
                snapshot["sched"] = scheds[0]
        a.restore(snapshot, lambda: self._restore(trainer))

    def _restore(self, trainer: Trainer) -> tuple[int, int] | None:
        done = int(trainer.global_step)
        accum = max(1, int(trainer.accumulate_grad_batches))
        per_epoch = None
        batches = trainer.num_training_batches
        if isinstance(batches, int) and batches > 0:
            per_epoch = max(1, batches // accum)
        newest = None if per_epoch is None else (done // per_epoch + 1) * per_epoch - 1
        if trainer.max_steps and trainer.max_steps > 0:
            newest = trainer.max_steps if newest is None else min(newest, trainer.max_steps)
        # Every loop internal the resume moves, found before anything is restored: one that a
        # Lightning release renamed raises here, and the framework's own resume stands as it
        # is (not the snapshot's weights with half of the loop's counters moved).
        loop = trainer.fit_loop.epoch_loop
        progress, scheduler = loop.batch_progress, loop.scheduler_progress
        optimizer = loop.automatic_optimization.optim_progress.optimizer
        stepped = int(loop._batches_that_stepped)
        step = self._a.started()[1].restore(self._a.state, min_step=done + 1, max_step=newest)
        if step is None or step <= done:
            return None
        delta = step - done
        _bump(progress, delta * accum)
        for tracker in (optimizer.step, optimizer.zero_grad, scheduler):
            _bump(tracker, delta)
        loop._batches_that_stepped = stepped + delta
        return step, done

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        beat = self._a.beat
        if beat is None or beat.open:
            return
        t0 = time.perf_counter()
        if self._spent:  # the last step's hooks
            report_overhead(self._a.telemetry, self._a.ckpt, self._spent)
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
        beat.begin(int(trainer.global_step), tokens=tokens, samples=samples, flops=flops)
        self._spent += time.perf_counter() - t0

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        beat = self._a.beat
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

    def _step_end(self, trainer: Trainer, outputs: Any, step: int) -> None:
        assert self._a.beat is not None
        self._a.beat.end()
        self._log(trainer, outputs, step)
        if self._a.step_boundary(step):
            self._preempt(trainer)

    def _log(self, trainer: Trainer, outputs: Any, step: int) -> None:
        telemetry = self._a.telemetry
        assert telemetry is not None
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
            telemetry.failed("mapping metrics")
            return
        telemetry.log(step, metrics)

    def _preempt(self, trainer: Trainer) -> None:
        """trainguard's preemption save ran: Lightning saves its last checkpoint (every rank:
        collective), and the process exits for a requeue."""
        trainer.should_stop = True
        cb = getattr(trainer, "checkpoint_callback", None)
        dirpath = getattr(cb, "dirpath", None)
        if dirpath:
            name = getattr(cb, "CHECKPOINT_NAME_LAST", "last") + getattr(
                cb, "FILE_EXTENSION", ".ckpt"
            )
            trainer.save_checkpoint(os.path.join(dirpath, name))
        self._a.finish()
        self._a.exit_preempted()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._a.finish()


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
