"""trainguard for the Hugging Face ``Trainer`` and what is built on it (TRL's ``SFTTrainer``,
``GRPOTrainer``, ``DPOTrainer``...). Tested with transformers 5.23 and TRL 1.16.

    from trainguard.integrations.hf import TrainGuardCallback
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[TrainGuardCallback()])

What it does, on every rank:

- a step heartbeat per optimizer step (``tg.step`` around HF's ``on_step_begin`` /
  ``on_step_end``, numbered by ``state.global_step``): hang and straggler detection, step
  time, tokens/s and FLOPs (tokens counted from the batches' ``input_ids``, FLOPs from the
  model's size and config);
- every value HF logs (``on_log``; rank 0 only, HF gives every rank the same reduced values)
  through ``tg.log``, with the metric contract's names where one exists;
- a snapshot of model, optimizer, scheduler, RNG and step into trainguard's checkpoint
  manager on the memory tier's cadence (the node's memory tier under ``trainguard run``;
  ``maybe_save(overlap=True)``: the ranks agree in the background, not at every step), and at
  ``on_train_begin`` a restore from it when it holds a newer step than the checkpoint HF
  resumed from (the data loader is moved on by the steps in between): a restart redoes at
  most the step in flight;
- a preemption notice (SIGTERM / SIGUSR1, ``[checkpoint] preemption_signals``), acted on at
  the ranks' next agreement (within 0.5 s of training): trainguard's preemption save, then HF
  saves its own checkpoint at that step boundary
  (``control.should_save``), training stops and the process exits with the requeue code 75.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainguard.integrations.adapter import FrameworkAdapter
from trainguard.integrations.common import (
    MetricMapper,
    batch_amounts,
    flops_per_token,
    report_overhead,
)

__all__ = ["TrainGuardCallback"]

if TYPE_CHECKING:
    from transformers import Trainer

logger = logging.getLogger(__name__)


def _find_trainer() -> Trainer | None:
    """The ``Trainer`` whose loop is calling: HF hands callbacks the model, optimizer and
    data loader, not the trainer, whose ``get_batch_samples`` the resume and token count need."""
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        me = frame.f_locals.get("self")
        if isinstance(me, Trainer):
            return me
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _inner(obj: Any, attr: str) -> Any:
    """accelerate's ``AcceleratedOptimizer`` / ``AcceleratedScheduler`` → the torch object."""
    return getattr(obj, attr, obj) if obj is not None else None


class TrainGuardCallback(TrainerCallback):
    """See the module docstring. ``resume=False``: heartbeats, metrics and preemption only
    (no per-step snapshots, no restore)."""

    def __init__(self, *, resume: bool = True) -> None:
        self._a = FrameworkAdapter("transformers", "hf", resume=resume)
        self._mapper = MetricMapper()
        self._skip = 0
        self._rng: Any = None
        self._amounts: tuple[int | None, int | None, int | None] = (None, None, None)
        self._fpt: float | None = None
        self._model: Any = None
        self._tokens_seen: int | None = None
        self._lag_tokens: int | None = None
        self._spent = 0.0  # this step's time in the hooks so far

    @property
    def resume(self) -> bool:
        return self._a.resume

    @property
    def resumed_step(self) -> int | None:
        """The step restored from trainguard's snapshot at ``on_train_begin``, or None."""
        return self._a.resumed_step

    # -- start ----------------------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> None:
        a = self._a
        a.start()
        self._model = kw.get("model")
        trainer = _find_trainer()
        if trainer is not None:
            a.guard("wrapping get_batch_samples", lambda: self._wrap_batches(trainer))
        optimizer = kw.get("optimizer")
        snapshot: dict[str, Any] = {}
        if self._model is not None and optimizer is not None:
            snapshot = {"model": self._model, "optim": _inner(optimizer, "optimizer")}
            sched = _inner(kw.get("lr_scheduler"), "scheduler")
            if sched is not None and hasattr(sched, "state_dict"):
                snapshot["sched"] = sched
        loader = kw.get("train_dataloader")
        a.restore(snapshot, lambda: self._restore(args, state, loader, trainer is not None))

    def _restore(
        self, args: TrainingArguments, state: TrainerState, loader: Any, can_skip: bool
    ) -> tuple[int, int] | None:
        """The newest trainguard snapshot newer than the step HF resumed from, in the same
        epoch (HF moves its data loader by epochs, trainguard by the steps in between)."""
        _, ckpt = self._a.started()
        done = int(state.global_step)
        ga = max(1, int(args.gradient_accumulation_steps))
        per_epoch = None
        try:
            per_epoch = max(1, math.ceil(len(loader) / ga))
        except Exception:
            pass
        newest = None if per_epoch is None else (done // per_epoch + 1) * per_epoch - 1
        if state.max_steps and state.max_steps > 0:
            newest = state.max_steps if newest is None else min(newest, state.max_steps)
        if not can_skip:  # cannot move the data loader: the framework's own resume only
            newest = done
        step = ckpt.restore(self._a.state, min_step=done + 1, max_step=newest)
        if step is None or step <= done:
            return None
        from trainguard.checkpoint.state import rng_state

        self._rng = rng_state()  # HF restores its own RNG state at the first batch: redo ours
        self._skip = (step - done) * ga
        state.global_step = step
        if per_epoch:
            state.epoch = step / per_epoch
        return step, done

    def _wrap_batches(self, trainer: Any) -> None:
        """Wrap this trainer's ``get_batch_samples`` (one call per optimizer step): skip the
        batches of restored steps, count each step's tokens."""
        if getattr(trainer, "_trainguard_batches", None) is self:
            return
        original = type(trainer).get_batch_samples
        me = self

        def get_batch_samples(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            if me._skip:
                skip, me._skip = me._skip, 0

                def skip_batches() -> None:
                    for _ in range(skip):
                        if next(epoch_iterator, None) is None:
                            break

                if not me._a.guard("skipping restored steps' batches", skip_batches):
                    me._skip, me._rng = 0, None
            batches, n = original(trainer, epoch_iterator, num_batches, device)
            try:
                me._amounts = batch_amounts(batches)
            except Exception:
                me._amounts = (None, None, None)
            return batches, n

        trainer.get_batch_samples = get_batch_samples
        trainer._trainguard_batches = self

    # -- steps ----------------------------------------------------------------------------------
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> None:
        if self._a.beat is None:
            return
        t0 = time.perf_counter()
        if self._spent:  # the last step's hooks (on_log comes after on_step_end)
            report_overhead(self._a.telemetry, self._a.ckpt, self._spent)
            self._spent = 0.0
        if self._rng is not None:
            from trainguard.checkpoint.state import set_rng_state

            set_rng_state(self._rng)
            self._rng = None
        tokens, samples, seq = self._amounts
        self._amounts = (None, None, None)
        if tokens is None:
            tokens = self._lag_tokens
        flops = None
        if tokens:
            if self._fpt is None and self._model is not None:
                self._fpt = flops_per_token(self._model, seq)
            flops = self._fpt * tokens if self._fpt else None
        self._tokens_seen = getattr(state, "num_input_tokens_seen", None)
        self._a.beat.begin(int(state.global_step), tokens=tokens, samples=samples, flops=flops)
        self._spent += time.perf_counter() - t0

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> TrainerControl | None:
        if self._a.beat is None:
            return None
        t0 = time.perf_counter()
        try:
            return self._step_end(state, control)
        finally:
            self._spent += time.perf_counter() - t0

    def _step_end(self, state: TrainerState, control: TrainerControl) -> TrainerControl:
        assert self._a.beat is not None
        seen = getattr(state, "num_input_tokens_seen", None)
        if seen and self._tokens_seen is not None and seen > self._tokens_seen:
            self._lag_tokens = int(seen - self._tokens_seen)  # the next step's estimate
        self._a.beat.end()
        if self._a.step_boundary(int(state.global_step)):
            # trainguard's state is saved (or nothing to save); now the framework's own
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> None:
        if self._a.preempted:
            self._a.finish()
            self._a.exit_preempted()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: object,
    ) -> None:
        # every rank gets the same (reduced) values: one series, from rank 0
        telemetry = self._a.telemetry
        if telemetry is None or not logs or not state.is_world_process_zero:
            return
        t0 = time.perf_counter()
        try:
            metrics = self._mapper.map(logs)
        except Exception:
            telemetry.failed("mapping metrics")
            return
        telemetry.log(int(state.global_step), metrics)
        self._spent += time.perf_counter() - t0

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> None:
        self._a.finish()
        if self._a.preempted:
            self._a.exit_preempted()
