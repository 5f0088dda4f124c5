"""What the transformers and Lightning callbacks share around the framework's loop: attach
(the worker API, the heartbeat, the checkpoint manager; the framework's version checked),
the guarded restore from trainguard's snapshot, the step boundary (a snapshot on the memory
tier's cadence, the ranks' preemption agreement) and the end of training. Each callback
keeps only what is its framework's own: where the hooks are, how the loop is moved on after a
restore, how the framework saves and stops.

A preemption is a returned flag (:meth:`FrameworkAdapter.step_boundary`), never an exception
round trip: the callback sets its framework's stop (and save) flags, and the process exits
with the requeue code once the framework saved its checkpoint.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainguard.core.failures import REQUEUE_EXIT_CODE
from trainguard.integrations._frameworks import check_version, guarded
from trainguard.integrations.common import SafeTelemetry, StepBeat

if TYPE_CHECKING:
    from trainguard.core.handles import CheckpointHandle
    from trainguard.worker.api import TrainGuard

__all__ = ["FrameworkAdapter"]

logger = logging.getLogger(__name__)


class FrameworkAdapter:
    """One per callback. ``framework``: the name events carry (``transformers``,
    ``lightning``); ``label``: the telemetry's short name (``hf``, ``lightning``)."""

    def __init__(self, framework: str, label: str, *, resume: bool) -> None:
        self.framework = framework
        self.label = label
        self.resume = resume
        self.tg: TrainGuard | None = None
        self.telemetry: SafeTelemetry | None = None
        self.beat: StepBeat | None = None
        self.ckpt: CheckpointHandle | None = None
        self.state: dict[str, Any] = {}
        """What trainguard snapshots (model, optimizer, scheduler); empty: resume is off."""
        self.resumed_step: int | None = None
        self.preempted = False

    def start(self) -> TrainGuard:
        """At the framework's train start: the worker API, the heartbeat, the checkpoint
        manager. Returns the worker API handle."""
        import trainguard

        check_version(self.framework)
        self.tg = tg = trainguard.init()
        self.telemetry = SafeTelemetry(tg, self.label)
        self.beat = StepBeat(self.telemetry)
        self.ckpt = tg.checkpoint
        return tg

    def started(self) -> tuple[TrainGuard, CheckpointHandle]:
        """The worker handle and its checkpoint manager; RuntimeError before :meth:`start`."""
        if self.tg is None or self.ckpt is None:
            raise RuntimeError(f"the {self.framework} integration is used before its train start")
        return self.tg, self.ckpt

    def guard(self, what: str, fn: Callable[[], object]) -> bool:
        """``fn()`` (a use of a framework internal); False after one warning and an
        ``integration_degraded`` event, and resume is off from here on."""
        ok, _ = guarded(self.tg, self.framework, what, fn)
        if not ok:
            self.resume_off()
        return ok

    def resume_off(self) -> None:
        self.resume = False
        self.state = {}
        self.resumed_step = None

    def restore(self, state: dict[str, Any], restore: Callable[[], tuple[int, int] | None]) -> None:
        """Snapshot ``state`` from here on and restore into it (``restore``: the framework's
        part; returns the step restored and the framework's own step before, or None),
        guarded; then tell the job we attached. The checkpoint manager is set up on every rank
        either way (collective)."""
        tg, ckpt = self.started()
        restored = False
        moved: list[tuple[int, int]] = []
        if self.resume and state:
            self.state = state

            def run() -> None:
                got = restore()
                if got is not None:
                    moved.append(got)

            restored = self.guard("restoring trainguard's snapshot", run)
        if not restored:
            ckpt.setup()  # the preemption handlers (collective: every rank is here)
        if restored and moved:
            self.resumed_step, done = moved[0]
            if tg.rank == 0:
                print(
                    f"trainguard: resumed at step {self.resumed_step} from its snapshot "
                    f"(the framework's checkpoint had step {done})",
                    file=sys.stderr,
                    flush=True,
                )
        if tg.rank == 0:
            tg.events.emit(
                "integration_attached",
                framework=self.framework,
                resume=bool(self.state),
                resumed_step=self.resumed_step,
            )

    def step_boundary(self, step: int) -> bool:
        """After optimizer step ``step``: a snapshot when one is due, and the ranks' agreement
        on a preemption notice. True once, at the boundary where the preemption save ran (or,
        with resume off, where the ranks agreed on the notice): the callback stops its loop."""
        if self.ckpt is None or self.preempted:
            return False
        tg, ckpt = self.started()
        if self.state:  # the ranks' agreement for the next step runs during it
            ckpt.maybe_save(step, self.state, overlap=True, exit_on_preemption=False)
            self.preempted = bool(ckpt.preempted)
        else:
            self.preempted = ckpt.preemption_agreed(step)
        if self.preempted and tg.rank == 0:
            tg.events.emit("integration_preempted", framework=self.framework, step=step)
        return self.preempted

    def finish(self) -> None:
        """At the framework's train end: the last heartbeat, and the snapshot in flight."""
        if self.beat is not None:
            self.beat.end()
            if self.tg is not None:
                self.tg.training_done()  # a final save or a slow exit is not a hang
        if self.ckpt is not None and not self.preempted:  # (closed after the preemption save)
            try:
                self.ckpt.settle_agreement()
                self.ckpt.wait()
            except Exception:
                logger.exception("trainguard snapshot in flight failed")

    @staticmethod
    def exit_preempted() -> None:
        """The framework saved its checkpoint after a preemption: exit for a requeue."""
        print(
            "trainguard: preempted; the framework saved its checkpoint, exiting with "
            f"{REQUEUE_EXIT_CODE} (requeue)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(REQUEUE_EXIT_CODE)
