"""The worker side of loss rollback: watch ``tg.log(loss=...)``, roll back on an anomaly.

Detection is local (:meth:`LossGuard.observe`, called by ``tg.log``); the decision is
collective without a collective of its own: ``tg.checkpoint.maybe_save``, which every rank
calls at every step boundary, adds this rank's anomalous step to the all-reduce it does anyway,
and when any rank reports one every rank calls :meth:`LossGuard.apply` with the same step.
That restores the newest checkpoint at or before the offending window (memory tier, else disk),
records the window in the ledger (``<run_dir>/rollback.json``), and moves ``tg.step_num`` past
it. Rollbacks exhausted at one place stop the job with the "do not requeue" code.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from trainguard.core.config.rollback import RollbackConfig
from trainguard.core.failures import DO_NOT_REQUEUE_EXIT_CODE
from trainguard.core.handles import WorkerHandle
from trainguard.recovery.rollback import Anomaly, LossMonitor, RollbackLedger, RollbackPlan

__all__ = ["LossGuard"]

logger = logging.getLogger(__name__)


class LossGuard:
    """One per worker handle (``tg._rollback``); see the module docstring."""

    def __init__(self, tg: WorkerHandle, config: RollbackConfig) -> None:
        self.tg = tg
        self.config = config
        self.monitor = LossMonitor(config)
        self.ledger = RollbackLedger.load(tg.run_dir, config)
        self._pending: Anomaly | None = None

    # -- detection (local) -----------------------------------------------------------------------
    def observe(self, step: int, metrics: Mapping[str, Any]) -> None:
        """``tg.log`` values of the step ``step`` (the data position that produced them)."""
        if self.config.metric not in metrics:
            return
        a = self.monitor.observe(step, metrics[self.config.metric])
        if a is None:
            return
        if self._pending is None or a.step < self._pending.step:
            self._pending = a
            self.tg.events.emit(
                "loss_anomaly",
                step=a.step,
                reason=a.reason,
                value=str(a.value) if a.reason != "spike" else a.value,
                median=a.median,
                metric=self.config.metric,
            )

    def pending(self) -> int | None:
        """This rank's offending step waiting for the ranks' agreement, or None."""
        return self._pending.step if self._pending is not None else None

    # -- the rollback (collective: every rank, same bad_step) ------------------------------------
    def apply(self, bad_step: int, step: int, state: MutableMapping[str, Any]) -> None:
        tg, mgr = self.tg, self.tg.checkpoint
        plan = self.ledger.plan(bad_step)
        if plan.stop:
            self._stop(plan, f"rollback {plan.count - 1} of {self.config.max_rollbacks} at "
                       "this place did not get past it")  # fmt: skip
        t0 = time.perf_counter()
        restored = mgr.restore(state, max_step=plan.max_step)
        if restored is None:
            self._stop(plan, f"no checkpoint at or before step {plan.max_step} to roll back to")
        assert restored is not None
        window = self.ledger.commit(plan, restored)
        mgr.discard_snapshots_after(restored)
        try:
            self.ledger.save(tg.run_dir)
        except OSError as e:
            logger.warning("could not write the rollback ledger in %s: %s", tg.run_dir, e)
        self.monitor.forget_from(restored)
        anomaly, self._pending = self._pending, None
        tg.step_num = self.ledger.next_step(restored)
        dt = time.perf_counter() - t0
        if tg.rank == 0:
            tg.events.emit(
                "loss_rollback",
                bad_step=bad_step,
                reason=anomaly.reason if anomaly is not None else "other",
                restored_step=restored,
                skip=list(window),
                resume_step=tg.step_num,
                rollbacks_here=plan.count,
                rollbacks=self.ledger.total,
                duration_s=round(dt, 4),
                from_step=step,
            )
            what = anomaly.describe() if anomaly is not None else "another rank's loss anomaly"
            print(
                f"trainguard: rank 0: {what} at step {bad_step}: rolled back to step {restored}, "
                f"skipping steps {window[0]}-{window[1]} (rollback {plan.count} of "
                f"{self.config.max_rollbacks} at this place)",
                file=sys.stderr,
                flush=True,
            )
        # the goodput accounting reads it from the metrics stream (kind "log")
        tg.log(step=bad_step, rollbacks=self.ledger.total, rollback_s=dt, rollback_to=restored)

    def _stop(self, plan: RollbackPlan, why: str) -> None:
        """Every rank: record, flush, leave together with the "do not requeue" code."""
        tg = self.tg
        line = (
            f"trainguard: loss anomaly at step {plan.bad_step}: {why}; stopping the job with "
            f"exit code {DO_NOT_REQUEUE_EXIT_CODE} (do not requeue): inspect the data and "
            f"the model around step {plan.bad_step} (skipped so far: "
            f"{', '.join(f'{a}-{b}' for a, b in self.ledger.windows) or 'none'})"
        )
        if tg.rank == 0:
            tg.events.emit(
                "rollback_exhausted",
                bad_step=plan.bad_step,
                rollbacks_here=plan.count - 1,
                max_rollbacks=self.config.max_rollbacks,
                reason=why,
                exitcode=DO_NOT_REQUEUE_EXIT_CODE,
            )
            print(line, file=sys.stderr, flush=True)
        try:
            tg.close()
        except Exception:
            logger.exception("closing the worker handle before the stop failed")
        _leave_together()
        os._exit(DO_NOT_REQUEUE_EXIT_CODE)


def _leave_together() -> None:
    """A barrier, so that no rank's exit tears down gloo under another one still closing (a
    peer's teardown can abort a process: pytorch/pytorch#179291)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    except Exception as e:  # leaving anyway
        logger.debug("barrier before the stop failed: %s", e)
