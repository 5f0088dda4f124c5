"""Hang detection: the agent watches every local worker's progress heartbeat.

A rank is *stalled* when it made no step progress for the hang timeout while it is inside a
step or its heartbeat is stale; a rank that is alive between steps (loading, evaluating,
checkpointing) gets the longer ``hang_idle_timeout_s``. On a stall the detector names the
rank(s) and node, tells "rank r frozen (heartbeat stale)" apart from "ranks waiting in a
collective for rank r" (fresh heartbeats, r behind), dumps every local rank's Python stack into
the run directory and the events, and SIGKILLs the worker group (a stopped process ignores
SIGTERM, torch would wait ``shutdown_timeout`` before escalating): the kills surface as the
group's FAILED state, so the agent's restart path and failure report take over.

A rank that never calls ``tg.step()`` is judged by its collective progress record (the agent
hands it over as the rank's progress). Before the kill, the diagnosis
(:mod:`trainguard.health.hangcollect`) collects every rank's flight-recorder trace and stacks, on
every node (the first agent to find the hang announces it in the rendezvous store; the others
join within half a second), and names the collective the job is stuck in.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

from trainguard.core import flight_recorder
from trainguard.core.config.health import HealthConfig
from trainguard.core.plugin import AgentContext, AgentPlugin
from trainguard.core.procs import kill_ranks
from trainguard.core.progress import ProgressSnapshot

__all__ = ["HangDetector", "HangTracker", "HangVerdict"]

logger = logging.getLogger(__name__)
_MAX_STACK_CHARS = 8000


@dataclass(slots=True)
class HangVerdict:
    kind: str
    """``frozen`` (a stale heartbeat), ``waiting_for`` (fresh heartbeats, one rank behind) or
    ``collective`` (all local ranks wait; the culprit is not on this node)."""
    ranks: list[int]
    """The hung ranks to name: frozen ones, the one the others wait for, or all."""
    waiting: list[int]
    message: str
    timeout_s: float
    per_rank: dict[int, dict[str, Any]] = field(default_factory=dict)


class HangTracker:
    """Pure logic over progress snapshots (no processes, injectable clock)."""

    def __init__(self, cfg: HealthConfig, *, heartbeat_interval_s: float = 1.0) -> None:
        self.cfg = cfg
        self.stale_s = cfg.heartbeat_stale_s or max(3.0 * heartbeat_interval_s, 2.0)
        self.reset(time.time())

    def reset(self, now: float) -> None:
        self.started = now
        self._num_steps: dict[int, int] = {}
        self._times: deque[float] = deque(maxlen=256)

    @property
    def median_step_s(self) -> float | None:
        return statistics.median(self._times) if self._times else None

    def step_timeout(self) -> float | None:
        """Timeout inside a step; None while the automatic timeout is still warming up."""
        if self.cfg.hang_timeout_s is not None:
            return self.cfg.hang_timeout_s
        median = self.median_step_s
        if median is None:
            return None
        return max(self.cfg.hang_min_timeout_s, self.cfg.hang_step_factor * median)

    def _learn(self, snaps: dict[int, ProgressSnapshot]) -> None:
        for r, s in snaps.items():
            if s.num_steps != self._num_steps.get(r):
                self._num_steps[r] = s.num_steps
                if s.num_steps > self.cfg.hang_warmup_steps and s.last_step_s > 0:
                    self._times.append(s.last_step_s)

    def observe(
        self,
        snaps: dict[int, ProgressSnapshot],
        now: float,
        *,
        process_state: Callable[[int], str | None] | None = None,
    ) -> HangVerdict | None:
        """``process_state(pid)`` (Linux ``/proc`` state letter, None when gone) lets exited
        ranks be skipped (their heartbeat stops too) and stopped ones be named as such."""
        self._learn(snaps)
        states: dict[int, str | None] = {}
        if process_state is not None:
            states = {r: process_state(s.pid) for r, s in snaps.items() if s.pid}
            snaps = {r: s for r, s in snaps.items() if states.get(r, "?") not in (None, "Z", "X")}
            if not snaps:
                return None
        step_timeout = self.step_timeout()
        per_rank: dict[int, dict[str, Any]] = {}
        stalled: list[int] = []
        frozen: list[int] = []
        for r, s in sorted(snaps.items()):
            last = max(s.step_start, s.step_end) or self.started
            age, hb_age = now - last, now - s.heartbeat
            is_frozen = hb_age > self.stale_s or states.get(r) == "T"
            if is_frozen:
                frozen.append(r)
                limit = step_timeout or self.cfg.hang_min_timeout_s
            elif s.in_step:
                limit = step_timeout or self.cfg.hang_idle_timeout_s
            else:
                limit = max(self.cfg.hang_idle_timeout_s, step_timeout or 0.0)
            per_rank[r] = {
                "step": s.step,
                "num_steps": s.num_steps,
                "in_step": s.in_step,
                "no_progress_s": round(age, 3),
                "heartbeat_age_s": round(hb_age, 3),
                "limit_s": limit,
                "pid": s.pid,
                "process_state": states.get(r),
            }
            if age > limit:
                stalled.append(r)
        if not stalled:
            return None
        return self._verdict(snaps, stalled, frozen, per_rank, step_timeout)

    def _verdict(
        self,
        snaps: dict[int, ProgressSnapshot],
        stalled: list[int],
        frozen: list[int],
        per_rank: dict[int, dict[str, Any]],
        step_timeout: float | None,
    ) -> HangVerdict:
        timeout = min(per_rank[r]["limit_s"] for r in stalled)
        others = [r for r in sorted(snaps) if r not in frozen]
        if frozen:
            ages = ", ".join(
                f"rank {r} {per_rank[r]['heartbeat_age_s']:.1f}s"
                + (" (process stopped)" if per_rank[r]["process_state"] == "T" else "")
                for r in frozen
            )
            msg = f"rank(s) {_fmt(frozen)} frozen (heartbeat stale: {ages})"
            if others:
                msg += f"; rank(s) {_fmt(others)} waiting in a collective for them"
            return HangVerdict("frozen", frozen, others, msg, timeout, per_rank)
        behind = min(snaps.values(), key=lambda s: (s.step, s.num_steps))
        ahead = [
            r for r, s in snaps.items() if (s.step, s.num_steps) > (behind.step, behind.num_steps)
        ]
        tied = [
            r for r, s in snaps.items() if (s.step, s.num_steps) == (behind.step, behind.num_steps)
        ]
        if ahead and len(tied) == 1:
            r = behind.rank
            msg = (
                f"rank(s) {_fmt(sorted(ahead))} waiting in a collective for rank {r} "
                f"(fresh heartbeats, no progress; rank {r} is at step {behind.step})"
            )
            return HangVerdict("waiting_for", [r], sorted(ahead), msg, timeout, per_rank)
        msg = (
            f"rank(s) {_fmt(sorted(snaps))} waiting in a collective (fresh heartbeats, no "
            f"progress for {timeout:g}s); the rank they wait for is not on this node"
        )
        return HangVerdict("collective", sorted(snaps), sorted(snaps), msg, timeout, per_rank)


def local_worker_pids(ctx: AgentContext, group: WorkerGroup) -> dict[int, int]:
    """Global rank → pid of this node's workers."""
    return ctx.worker_pids()


def kill_workers(pids: dict[int, int]) -> list[int]:
    """SIGKILL every worker (a stopped process ignores SIGTERM); returns the ranks killed.

    The kills surface on the agent's next monitor tick as torch's own FAILED result (exit -9
    per rank, the failure report, the restart path). Returning an UNHEALTHY RunResult instead
    would, with no restarts left, end the job as "succeeded" in torch's launch path."""
    return kill_ranks(pids)


def process_state(pid: int) -> str | None:
    """State letter of ``pid`` from /proc (R, S, D, T stopped, Z zombie...); None when the
    process is gone; "?" where /proc is not available."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None
    except (OSError, IndexError):
        return "?"


def _fmt(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks)


class HangDetector(AgentPlugin):
    """Agent plugin around :class:`HangTracker`; see the module docstring."""

    name = "hang"

    def __init__(
        self,
        cfg: HealthConfig,
        *,
        heartbeat_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.tracker = HangTracker(cfg, heartbeat_interval_s=heartbeat_interval_s)
        self._clock = clock
        self._fired = False
        self.num_hangs = 0
        self._next_peer_check = 0.0
        self.last_diagnosis: Any = None

    def worker_hooks(self, ctx: AgentContext) -> Sequence[str]:
        """Every worker reads its collective progress from torch's flight recorder (scripts
        that never call ``tg.step()`` are judged by it) and answers dump requests."""
        return (flight_recorder.WORKER_HOOK,)

    def on_workers_started(self, ctx: AgentContext, group: WorkerGroup) -> None:
        self.tracker.reset(self._clock())
        self._fired = False

    def on_monitor(
        self, ctx: AgentContext, group: WorkerGroup, result: RunResult
    ) -> RunResult | None:
        if self._fired:
            return None
        if self._peer_announced(ctx):
            self._fired = True
            self._handle_peer(ctx, group)
            return None
        snaps = ctx.worker_progress()
        if not snaps:
            return None
        verdict = self.tracker.observe(snaps, self._clock(), process_state=process_state)
        if verdict is None:
            return None
        self._fired = True
        self.num_hangs += 1
        self._handle(ctx, group, verdict)
        return None  # the kills surface as FAILED on the next tick (see kill_workers)

    def _handle(self, ctx: AgentContext, group: WorkerGroup, v: HangVerdict) -> None:
        node = ctx.events.node
        logger.error("hang on node %s: %s", node, v.message)
        ctx.events.emit(
            "hang_detected",
            hang_kind=v.kind,
            ranks=v.ranks,
            waiting_ranks=v.waiting,
            message=f"{v.message} on node {node}",
            timeout_s=v.timeout_s,
            median_step_s=self.tracker.median_step_s,
            per_rank={str(r): d for r, d in v.per_rank.items()},
        )
        pids = local_worker_pids(ctx, group)
        stacks: dict[int, dict[str, str]] = {}
        if self.cfg.hang_diagnosis:
            from trainguard.core.contracts.rundir import RunDir
            from trainguard.health.hangcollect import local_stacks

            self._diagnose(ctx, group, pids, frozen=set(v.ranks) if v.kind == "frozen" else set())
            # the diagnosis took every rank's stack it could: taken once
            stacks = local_stacks(RunDir(ctx.run_dir).hang(max(ctx.attempt, 0)), sorted(pids))
        if self.cfg.stack_dump and pids:
            from trainguard.health.stacks import dump_stacks

            rest = {r: p for r, p in pids.items() if r not in stacks}
            if rest:
                stacks.update(
                    dump_stacks(
                        rest,
                        run_dir=ctx.run_dir,
                        attempt=max(ctx.attempt, 0),
                        timeout_s=self.cfg.stack_dump_timeout_s,
                    )
                )
            ctx.events.emit(
                "hang_stacks",
                ranks=sorted(stacks),
                stacks={
                    str(r): {
                        "method": d["method"],
                        "path": d["path"],
                        "stack": d["stack"][-_MAX_STACK_CHARS:],
                    }
                    for r, d in stacks.items()
                },
            )
        killed = kill_workers(pids)
        ctx.events.emit("hang_killed", ranks=killed, pids={str(r): pids[r] for r in killed})

    # -- diagnosis across nodes (trainguard.health.hangcollect) -------------------------------
    def _peer_announced(self, ctx: AgentContext) -> bool:
        """Another node's agent found a hang of this attempt (checked every 0.5 s)."""
        now = time.monotonic()
        if ctx.store is None or not self.cfg.hang_diagnosis or now < self._next_peer_check:
            return False
        self._next_peer_check = now + 0.5
        try:
            return bool(ctx.store.check([hang_store_key(ctx)]))
        except Exception as e:
            logger.debug("cannot read the rendezvous store: %s", e)
            return False

    def _handle_peer(self, ctx: AgentContext, group: WorkerGroup) -> None:
        logger.error("hang announced by another node: collecting this node's ranks")
        pids = local_worker_pids(ctx, group)
        self._diagnose(ctx, group, pids, frozen=set())
        killed = kill_workers(pids)
        ctx.events.emit("hang_killed", ranks=killed, pids={str(r): pids[r] for r in killed})

    def _diagnose(
        self, ctx: AgentContext, group: WorkerGroup, pids: dict[int, int], *, frozen: set[int]
    ) -> None:
        from trainguard.health.hangcollect import collect_and_analyse

        try:
            world = group.workers[0].world_size if group.workers else len(pids)
            diag = collect_and_analyse(
                ctx,
                pids,
                frozen=frozen,
                world_size=world,
                timeout_s=self.cfg.hang_diagnosis_timeout_s,
                store_key=hang_store_key(ctx),
                process_state=process_state,
            )
        except Exception:
            logger.exception("hang diagnosis failed")
            return
        self.last_diagnosis = diag
        logger.error("hang diagnosis (%s): %s", diag.kind, diag.message)
        ctx.events.emit(
            "hang_diagnosis",
            diagnosis=diag.kind,
            message=diag.message,
            pg=diag.pg,
            op=diag.op,
            seq=diag.seq,
            suspect_ranks=diag.suspect_ranks,
            suspect_hosts=diag.suspect_hosts,
            groups=diag.groups,
            frames=diag.frames,
            stack_groups=[
                {"ranks": g["ranks"], "stack": g["stack"][-_MAX_STACK_CHARS:]} for g in diag.stacks
            ],
            missing_dumps=diag.missing_dumps,
        )


def hang_store_key(ctx: AgentContext) -> str:
    """Where the agent that finds a hang announces it to the other nodes' agents."""
    return f"trainguard/hang/{max(ctx.attempt, 0)}"
