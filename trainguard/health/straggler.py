"""Straggler detection: per-rank step times → a score 0–1 against the other ranks' median.

``score = max(0, 1 - median(other ranks) / rank)`` over a rolling window of steps all local
ranks completed, after warm-up: 0 for a rank at or below the median, 0.33 for a rank 50 %
slower, → 1 for a rank that barely moves. A rank at or above ``straggler_threshold`` (and
``straggler_min_delta_s`` above the median) for ``straggler_patience`` consecutive evaluations
is reported once per attempt (event ``straggler_detected``; scores in
``<run_dir>/health/straggler_scores.<node>.json``; telemetry gets them over the event bus). With ``straggler_policy = "exclude"`` the
node then leaves the job (event ``node_excluded``, :class:`NodeUnhealthyError` from the agent's
monitor loop): a single-node job fails, an elastic one carries on without this node.

"The other ranks" are all ranks of the job: every poll, each node's agent publishes its local
ranks' window medians in the agent store (``trainguard/health/straggler/<attempt>/<group
rank>``) and reads the other nodes' (a node that has not published yet is skipped, never
waited for). Each node scores and reports only its own ranks, so a straggler is reported once,
by the node it runs on. Store errors are logged and counted, never raised into the agent.

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
from collections.abc import Mapping
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

from trainguard.core.atomicfile import write_atomic
from trainguard.core.config.health import HealthConfig
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import MSG_STRAGGLER_SCORES
from trainguard.core.jsonl import JsonlTail
from trainguard.core.plugin import AgentContext, AgentPlugin, NodeUnhealthyError

__all__ = ["StragglerDetector", "StragglerScorer"]

logger = logging.getLogger(__name__)

STORE_PREFIX = "trainguard/health/straggler"


class StragglerScorer:
    """Pure logic: feed ``(rank, step, seconds)`` for the local ranks and, optionally, the
    other nodes' current window medians (:meth:`set_remote`); :meth:`evaluate` returns new
    verdicts about the local ranks only."""

    def __init__(self, cfg: HealthConfig, ranks: list[int]) -> None:
        self.cfg = cfg
        self.ranks = sorted(ranks)
        self._times: dict[int, dict[int, float]] = {r: {} for r in self.ranks}
        self._first_step: int | None = None
        self._evaluated: set[int] = set()
        self._streak: dict[int, int] = dict.fromkeys(self.ranks, 0)
        self._remote: dict[int, float] = {}
        self.reported: set[int] = set()
        self.scores: dict[int, float] = {}
        self.num_evaluations = 0
        self.latest: dict[int, float] = {}
        """The local ranks' medians over the latest complete window (what a node publishes)."""
        self.latest_step: int | None = None
        """Last step of that window."""

    def add(self, rank: int, step: int, seconds: float, *, compute: bool = False) -> None:
        if rank not in self._times or seconds <= 0:
            return
        times = self._times[rank]
        if compute or step not in times:
            times[step] = seconds
        if self._first_step is None or step < self._first_step:
            self._first_step = step

    def set_remote(self, medians: Mapping[int, float]) -> None:
        """The current window medians of ranks on other nodes (replaces the previous ones).
        They join "the others' median" of every local rank; local ranks in ``medians`` are
        ignored."""
        self._remote = {
            int(r): float(m) for r, m in medians.items() if int(r) not in self._times and m > 0
        }

    @property
    def remote(self) -> dict[int, float]:
        return dict(self._remote)

    def _common_steps(self) -> list[int]:
        if self._first_step is None:
            return []
        start = self._first_step + self.cfg.straggler_warmup_steps
        sets = [set(t) for t in self._times.values()]
        common = set.intersection(*sets) if sets else set()
        return sorted(s for s in common if s >= start)

    def evaluate(self) -> list[dict[str, Any]]:
        """New persistent stragglers among the local ranks since the last call (each once)."""
        new: list[dict[str, Any]] = []
        steps = self._common_steps()
        w = self.cfg.straggler_window
        remote = list(self._remote.values())
        for i in range(w - 1, len(steps)):
            end = steps[i]
            if end in self._evaluated:
                continue
            window = steps[i - w + 1 : i + 1]
            per_rank = {r: statistics.median(self._times[r][s] for s in window) for r in self.ranks}
            self.latest, self.latest_step = per_rank, end
            if len(per_rank) + len(remote) < 2:
                # Nobody to compare with yet (the other nodes have not published): scored
                # once they have, against their then current medians.
                continue
            self._evaluated.add(end)
            self.num_evaluations += 1
            for r in self.ranks:
                others = statistics.median([v for q, v in per_rank.items() if q != r] + remote)
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
                            "ratio": round(per_rank[r] / others, 3),  # times are > 0
                            "ranks_compared": len(per_rank) + len(remote),
                            "window": w,
                        }
                    )
        # Forget what no window needs any more.
        if len(steps) > 4 * w:
            for s in steps[: -2 * w]:
                for t in self._times.values():
                    t.pop(s, None)
            self._evaluated = {s for s in self._evaluated if s >= steps[-2 * w]}
        return new


class StragglerDetector(AgentPlugin):
    """Agent plugin: tails local ranks' metrics, exchanges window medians with the other
    nodes through the agent store and reports (or, by policy, leaves over) persistent
    stragglers among the local ranks."""

    name = "straggler"

    def __init__(
        self, cfg: HealthConfig, *, poll_interval_s: float = 0.5, remote_stale_s: float = 30.0
    ) -> None:
        self.cfg = cfg
        self.poll_interval_s = poll_interval_s
        self.remote_stale_s = remote_stale_s
        self.scorer: StragglerScorer | None = None
        self._tails: dict[int, JsonlTail] = {}
        self._attempt = -1
        self._next_poll = 0.0
        self._store: Any = None
        self._group_rank = 0
        self._group_world = 1
        self._published_step: int | None = None
        self._seen: dict[int, tuple[bytes, float]] = {}  # group rank -> (entry, first seen)
        self.remote_nodes: dict[int, dict[str, Any]] = {}  # group rank -> latest fresh entry
        self.num_store_errors = 0
        self.reports: list[dict[str, Any]] = []

    def on_workers_started(self, ctx: AgentContext, group: WorkerGroup) -> None:
        ranks = [w.global_rank for w in group.workers]
        self.scorer = StragglerScorer(self.cfg, ranks)
        self._attempt = max(ctx.attempt, 0)
        self._store = getattr(group, "store", None)
        self._group_rank = group.group_rank or 0
        self._group_world = group.group_world_size or 1
        self._published_step = None
        self._seen = {}
        self.remote_nodes = {}
        self._tails = {}
        for r in ranks:
            tail = JsonlTail(RunDir(ctx.run_dir).metrics(r))
            try:  # skip what earlier attempts wrote
                tail.offset = tail.path.stat().st_size
            except OSError:
                pass
            self._tails[r] = tail

    def on_monitor(
        self, ctx: AgentContext, group: WorkerGroup, result: RunResult
    ) -> RunResult | None:
        now = time.monotonic()
        if self.scorer is None or now < self._next_poll:
            return None
        self._next_poll = now + self.poll_interval_s
        found = self.poll(ctx)
        if found and self.cfg.straggler_policy == "exclude":
            self._exclude(ctx, found)
        return None

    def on_finish(self, ctx: AgentContext, state: str) -> None:
        if self.scorer is not None:
            self.poll(ctx, exchange=False)  # the other nodes (and the store) may be gone

    # -- one poll ------------------------------------------------------------------------------
    def poll(self, ctx: AgentContext, *, exchange: bool = True) -> list[dict[str, Any]]:
        """Read new step times, exchange medians with the other nodes, report new stragglers."""
        assert self.scorer is not None
        for r, tail in self._tails.items():
            for rec in tail.read():
                if rec.get("attempt", self._attempt) != self._attempt or "step" not in rec:
                    continue
                if rec.get("kind") == "step" and "step_time_s" in rec:
                    self.scorer.add(r, int(rec["step"]), float(rec["step_time_s"]))
                elif "compute_time_s" in rec:
                    self.scorer.add(r, int(rec["step"]), float(rec["compute_time_s"]), compute=True)
        cross = exchange and self._store is not None and self._group_world > 1
        if cross:
            self._read_remote()
        found = self.scorer.evaluate()
        if cross:
            self._publish(ctx)
        for f in found:
            self.reports.append(f)
            logger.warning(
                "rank %d is a straggler on node %s (score %.2f, %.2fx the median of %d other ranks)",
                f["rank"],
                ctx.events.node,
                f["score"],
                f["ratio"],
                f["ranks_compared"] - 1,
            )
            ctx.events.emit(
                "straggler_detected",
                message=f"rank {f['rank']} on node {ctx.events.node} is "
                f"{f['ratio']:.2f}x the other ranks' median step time",
                **f,
            )
        if self.scorer.scores:
            self._write_scores(ctx)
        return found

    def _key(self, group_rank: int) -> str:
        return f"{STORE_PREFIX}/{self._attempt}/{group_rank}"

    def _store_error(self, what: str, e: Exception) -> None:
        self.num_store_errors += 1
        log = logger.warning if self.num_store_errors <= 3 else logger.debug
        log("straggler exchange: cannot %s the agent store: %s", what, e)

    def _publish(self, ctx: AgentContext) -> None:
        assert self.scorer is not None
        step = self.scorer.latest_step
        if step is None or step == self._published_step:
            return
        entry = {
            "node": ctx.events.node,
            "step": step,
            "medians": {str(r): m for r, m in self.scorer.latest.items()},
        }
        try:
            self._store.set(self._key(self._group_rank), json.dumps(entry))
            self._published_step = step
        except Exception as e:
            self._store_error("write", e)

    def _read_remote(self) -> None:
        assert self.scorer is not None
        now = time.monotonic()
        for g in range(self._group_world):
            if g == self._group_rank:
                continue
            key = self._key(g)
            try:
                if not self._store.check([key]):
                    continue  # not published yet: never wait for it
                raw = bytes(self._store.get(key))
            except Exception as e:
                self._store_error("read", e)
                continue
            prev = self._seen.get(g)
            if prev is None or prev[0] != raw:
                self._seen[g] = (raw, now)
                try:
                    entry = json.loads(raw)
                    entry["medians"] = {int(r): float(m) for r, m in entry["medians"].items()}
                    self.remote_nodes[g] = entry
                except Exception as e:  # anything a writer of the store put there
                    self._store_error("decode an entry of", e)
                    self.remote_nodes.pop(g, None)
            elif now - prev[1] > self.remote_stale_s:
                self.remote_nodes.pop(g, None)  # that node stopped stepping (or left)
        self.scorer.set_remote(
            {r: m for e in self.remote_nodes.values() for r, m in e["medians"].items()}
        )

    # -- exclusion -----------------------------------------------------------------------------
    def _exclude(self, ctx: AgentContext, found: list[dict[str, Any]]) -> None:
        node = ctx.events.node
        reasons = [
            f"rank {f['rank']} is a straggler: score {f['score']:.2f}, "
            f"{f['ratio']:.2f}x the median step time of the "
            f"job's {f['ranks_compared'] - 1} other rank(s)"
            for f in found
        ]
        logger.error("node %s leaves the job (straggler_policy=exclude): %s", node, reasons)
        ctx.events.emit(
            "node_excluded",
            reason="straggler",
            reasons=reasons,
            ranks=[f["rank"] for f in found],
            scores={str(f["rank"]): f["score"] for f in found},
        )
        raise NodeUnhealthyError(f"node {node} excluded: " + "; ".join(reasons))

    def _write_scores(self, ctx: AgentContext) -> None:
        """Tell the other plugins (telemetry) the scores over the bus, and leave them for
        people and tests in ``<run_dir>/health/straggler_scores.<node>.json`` (no plugin
        reads that file)."""
        assert self.scorer is not None
        scores = {str(r): s for r, s in self.scorer.scores.items()}
        ctx.events.publish(
            MSG_STRAGGLER_SCORES, scores=scores, stragglers=sorted(self.scorer.reported)
        )
        path = RunDir(ctx.run_dir).straggler_scores(ctx.node)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(
                path,
                json.dumps(
                    {
                        "time": time.time(),
                        "attempt": self._attempt,
                        "node": ctx.node,
                        "scores": scores,
                        "stragglers": sorted(self.scorer.reported),
                        "remote_medians_s": {
                            str(r): {"node": e.get("node"), "median_s": m}
                            for e in self.remote_nodes.values()
                            for r, m in e["medians"].items()
                        },
                    }
                ),
            )
        except OSError as e:
            logger.debug("cannot write straggler scores: %s", e)
