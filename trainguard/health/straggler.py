"""Straggler detection: per-rank step times → a score 0–1 against the other ranks' median.

``score = max(0, 1 - median(other ranks) / rank)`` over a rolling window of steps all local
ranks completed, after warm-up: 0 for a rank at or below the median, 0.33 for a rank 50 %
slower, → 1 for a rank that barely moves. A rank at or above ``straggler_threshold`` (and
``straggler_min_delta_s`` above the median) for ``straggler_patience`` consecutive evaluations
is reported once per attempt (event
``straggler_detected``; scores in ``<run_dir>/health/straggler_scores.json``).

Step times come from the workers' metrics records (``<run_dir>/metrics/rank_<r>.jsonl``):
``step_time_s`` of each ``tg.step()``, or, when the worker logs it, ``compute_time_s`` for that
step. In synchronous data parallelism every rank's wall step time is equalised by the
all-reduce (the fast ranks wait inside the step for the slow one; a rank slow *between* steps
even shows the *shortest* step time), so wall step times find stragglers only among ranks that
do not synchronise every step (rollout workers, pipelines). A worker that logs its own compute
time before the collective (``tg.log(compute_time_s=...)``) makes the straggler visible in
synchronous training; that value wins over the wall time for its step.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

from trainguard.health.config import HealthConfig
from trainguard.runtime.jsonl import JsonlTail
from trainguard.runtime.plugin import AgentPlugin

if TYPE_CHECKING:
    from trainguard.runtime.agent import TrainGuardAgent

__all__ = ["StragglerDetector", "StragglerScorer"]

logger = logging.getLogger(__name__)


class StragglerScorer:
    """Pure logic: feed ``(rank, step, seconds)``; call :meth:`evaluate` for new verdicts."""

    def __init__(self, cfg: HealthConfig, ranks: list[int]) -> None:
        self.cfg = cfg
        self.ranks = sorted(ranks)
        self._times: dict[int, dict[int, float]] = {r: {} for r in self.ranks}
        self._first_step: int | None = None
        self._evaluated: set[int] = set()
        self._streak: dict[int, int] = dict.fromkeys(self.ranks, 0)
        self.reported: set[int] = set()
        self.scores: dict[int, float] = {}
        self.num_evaluations = 0

    def add(self, rank: int, step: int, seconds: float, *, compute: bool = False) -> None:
        if rank not in self._times or seconds <= 0:
            return
        times = self._times[rank]
        if compute or step not in times:
            times[step] = seconds
        if self._first_step is None or step < self._first_step:
            self._first_step = step

    def _common_steps(self) -> list[int]:
        if self._first_step is None:
            return []
        start = self._first_step + self.cfg.straggler_warmup_steps
        sets = [set(t) for t in self._times.values()]
        common = set.intersection(*sets) if sets else set()
        return sorted(s for s in common if s >= start)

    def evaluate(self) -> list[dict[str, Any]]:
        """New persistent stragglers since the last call (each reported once)."""
        if len(self.ranks) < 2:
            return []
        new: list[dict[str, Any]] = []
        steps = self._common_steps()
        w = self.cfg.straggler_window
        for i in range(w - 1, len(steps)):
            end = steps[i]
            if end in self._evaluated:
                continue
            self._evaluated.add(end)
            window = steps[i - w + 1 : i + 1]
            per_rank = {r: statistics.median(self._times[r][s] for s in window) for r in self.ranks}
            self.num_evaluations += 1
            for r in self.ranks:
                others = statistics.median(v for q, v in per_rank.items() if q != r)
                score = max(0.0, 1.0 - others / per_rank[r]) if per_rank[r] > 0 else 0.0
                self.scores[r] = round(score, 4)
                slow = (
                    score >= self.cfg.straggler_threshold
                    and per_rank[r] - others >= self.cfg.straggler_min_delta_s
                )
                self._streak[r] = self._streak[r] + 1 if slow else 0
                if self._streak[r] >= self.cfg.straggler_patience and r not in self.reported:
                    self.reported.add(r)
                    new.append(
                        {
                            "rank": r,
                            "score": round(score, 4),
                            "step": end,
                            "step_time_s": per_rank[r],
                            "median_others_s": others,
                            "window": w,
                        }
                    )
        # Forget what no window needs any more.
        if len(steps) > 4 * w:
            for s in steps[: -2 * w]:
                for t in self._times.values():
                    t.pop(s, None)
        return new


class StragglerDetector(AgentPlugin):
    """Agent plugin: tails local ranks' metrics and reports persistent stragglers."""

    name = "straggler"

    def __init__(self, cfg: HealthConfig, *, poll_interval_s: float = 0.5) -> None:
        self.cfg = cfg
        self.poll_interval_s = poll_interval_s
        self.scorer: StragglerScorer | None = None
        self._tails: dict[int, JsonlTail] = {}
        self._attempt = -1
        self._next_poll = 0.0
        self.reports: list[dict[str, Any]] = []

    def on_workers_started(self, agent: TrainGuardAgent, group: WorkerGroup) -> None:
        ranks = [w.global_rank for w in group.workers]
        self.scorer = StragglerScorer(self.cfg, ranks)
        self._attempt = max(agent.attempt, 0)
        metrics = Path(agent.run_dir) / "metrics"
        self._tails = {}
        for r in ranks:
            tail = JsonlTail(metrics / f"rank_{r}.jsonl")
            try:  # skip what earlier attempts wrote
                tail.offset = tail.path.stat().st_size
            except OSError:
                pass
            self._tails[r] = tail

    def on_monitor(
        self, agent: TrainGuardAgent, group: WorkerGroup, result: RunResult
    ) -> RunResult | None:
        now = time.monotonic()
        if self.scorer is None or now < self._next_poll:
            return None
        self._next_poll = now + self.poll_interval_s
        self.poll(agent)
        return None

    def on_finish(self, agent: TrainGuardAgent, state: str) -> None:
        if self.scorer is not None:
            self.poll(agent)

    def poll(self, agent: TrainGuardAgent) -> None:
        assert self.scorer is not None
        for r, tail in self._tails.items():
            for rec in tail.read():
                if rec.get("attempt", self._attempt) != self._attempt or "step" not in rec:
                    continue
                if rec.get("kind") == "step" and "step_time_s" in rec:
                    self.scorer.add(r, int(rec["step"]), float(rec["step_time_s"]))
                elif "compute_time_s" in rec:
                    self.scorer.add(r, int(rec["step"]), float(rec["compute_time_s"]), compute=True)
        for found in self.scorer.evaluate():
            self.reports.append(found)
            logger.warning(
                "rank %d is a straggler on node %s (score %.2f)",
                found["rank"],
                agent.events.node,
                found["score"],
            )
            agent.events.emit(
                "straggler_detected",
                message=f"rank {found['rank']} is {found['step_time_s'] / found['median_others_s']:.2f}x "
                f"the other ranks' median step time",
                **found,
            )
        if self.scorer.scores:
            self._write_scores(agent)

    def _write_scores(self, agent: TrainGuardAgent) -> None:
        assert self.scorer is not None
        path = Path(agent.run_dir) / "health" / f"straggler_scores.{agent.events.node}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(
                json.dumps(
                    {
                        "time": time.time(),
                        "attempt": self._attempt,
                        "scores": {str(r): s for r, s in self.scorer.scores.items()},
                        "stragglers": sorted(self.scorer.reported),
                    }
                )
            )
            tmp.replace(path)
        except OSError as e:
            logger.debug("cannot write straggler scores: %s", e)
