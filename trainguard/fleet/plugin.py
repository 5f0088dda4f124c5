"""The fleet agent plugin: this node's history into the fleet database, and the lemon gate.

- before the first rendezvous: a lemon node (:mod:`trainguard.fleet.lemons`) refuses to join
  (event ``node_refused`` with ``lemon`` and its history, exit 94; a spare takes its place).
  An unreachable database admits the node (one warning): the gate never stops a job for it;
- during the job: every ``failure_attributed``, ``node_evicted``, ``health_unhealthy`` and
  straggler ``node_excluded`` event becomes a record (queued: a write never blocks training);
- when the agent ends (before ``job_finished``): waiting records get ``[fleet]
  flush_timeout_s`` to land.

- with ``[fleet] sniff_interval_s``: the workers' sniff results (:mod:`trainguard.fleet.sniff`)
  are judged; a rank that became slow is flagged (event ``sniff_degraded``), recorded, and with
  ``[health] straggler_policy = "exclude"`` the node leaves the job (``node_excluded``);
  telemetry gets the results over the bus (``sniff_results``).

Events: ``fleet_records`` (at the end: written, waiting, dropped, the last error).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

from trainguard.core.config.fleet import FleetConfig
from trainguard.core.contracts.actions import Cause, HealthAction, Verdict
from trainguard.core.contracts.event_kinds import (
    FAILURE_ATTRIBUTED,
    FLEET_RECORDS,
    HEALTH_UNHEALTHY,
    NODE_EVICTED,
    NODE_EXCLUDED,
    NODE_REFUSED,
    SNIFF_DEGRADED,
    SNIFF_RESULTS,
)
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.jsonl import JsonlTail
from trainguard.core.plugin import AgentContext, AgentPlugin, NodeEvictedError, NodeUnhealthyError
from trainguard.fleet.db import FleetDB, FleetDBError, Record, open_db, safe_node_name
from trainguard.fleet.lemons import lemon_status
from trainguard.fleet.sniff import SniffJudge, fleet_baseline
from trainguard.fleet.writer import FleetWriter

__all__ = ["FleetPlugin", "fleet_db"]

logger = logging.getLogger(__name__)

_WATCHED = [FAILURE_ATTRIBUTED, NODE_EVICTED, HEALTH_UNHEALTHY, NODE_EXCLUDED]


def fleet_db(cfg: FleetConfig, runs_root: str, *, node: str | None = None) -> FleetDB:
    """The fleet database; as ``node``'s role (``[fleet] node_role``) for that node's agent."""
    role = cfg.role_of(node) if node is not None else ""
    return open_db(cfg.url, runs_root=runs_root, connect_timeout_s=cfg.connect_timeout_s, role=role)


def _eviction_cause(reason: str) -> str:
    r = reason.lower()
    hardware = Cause.HARDWARE.value
    if f": {Cause.SDC.value}: " in r:
        return Cause.SDC.value
    return hardware if r.startswith("health") or hardware in r else "repeated_failures"


class FleetPlugin(AgentPlugin):
    name = "fleet"

    def __init__(self, ctx: AgentContext) -> None:
        self.cfg = ctx.config.fleet
        self.runs_root = ctx.config.runtime.runs_root
        node, changed = safe_node_name(ctx.node)
        self.node = node
        self.warnings = 0
        self.gate_error: str | None = None
        """Why the lemon check was skipped (one line, scrubbed), for ``fleet_records``."""
        if changed:
            self.warnings += 1
            logger.warning("fleet database: node name %r recorded as %r", ctx.node, node)
        self.job = ctx.run_id
        self.writer = FleetWriter(
            lambda: fleet_db(self.cfg, self.runs_root, node=self.node),
            queue_max=self.cfg.queue_max,
            retry_s=self.cfg.retry_s,
        )
        self._gated = False
        self._closed = False
        ctx.events.subscribe(self._on_event, _WATCHED)
        self.straggler_policy = ctx.config.health.straggler_policy
        self.judge: SniffJudge | None = None
        self.baseline: dict[str, float] = {}
        self._baseline_loader: threading.Thread | None = None
        self._tails: dict[int, JsonlTail] = {}
        self._sniff_attempt = -1
        self._next_poll = 0.0
        self._last_summary = 0.0

    # -- records -------------------------------------------------------------------------------
    def _record(self, kind: str, event: dict[str, Any], **fields: Any) -> None:
        attempt = event.get("failed_attempt", event.get("attempt", -1))
        self.writer.put(
            Record(
                node=self.node,
                kind=kind,
                job=self.job,
                attempt=int(attempt) if isinstance(attempt, int) else -1,
                time=float(event.get("time") or time.time()),
                **fields,
            )
        )

    def _on_event(self, event: dict[str, Any]) -> None:
        try:
            kind = event.get("kind")
            if kind == FAILURE_ATTRIBUTED:
                ev = event.get("evidence") or {}
                self._record(
                    "failure",
                    event,
                    cause=str(event.get("cause") or ""),
                    verdict=str(event.get("verdict") or ""),
                    detail={
                        "summary": event.get("summary"),
                        "ranks": event.get("ranks"),
                        "deterministic": event.get("deterministic"),
                        **{k: ev[k] for k in ("exception", "place", "figure", "health") if k in ev},
                    },
                )
            elif kind == NODE_EVICTED:
                reason = str(event.get("reason") or "")
                self._record(
                    "eviction",
                    event,
                    cause=_eviction_cause(reason),
                    verdict=Verdict.EVICT.value,
                    detail={"reason": reason, "until": event.get("until")},
                )
            elif kind == HEALTH_UNHEALTHY:
                reasons = event.get("reasons") or []
                self._record(
                    "health",
                    event,
                    cause=Cause.HARDWARE.value,
                    verdict=str(event.get("action") or ""),
                    detail={"summary": "; ".join(map(str, reasons))[:1000], "reasons": reasons},
                )
            elif kind == NODE_EXCLUDED and event.get("action") != HealthAction.DRAIN:
                self._record(
                    "straggler" if event.get("scores") or "slow" in str(event) else "excluded",
                    event,
                    cause="straggler",
                    verdict="exclude",
                    detail={"reason": event.get("reason"), "reasons": event.get("reasons")},
                )
        except Exception as e:  # never raised into the agent
            self.warnings += 1
            logger.warning("fleet database: event %s not recorded: %s", event.get("kind"), e)

    # -- the lemon gate ------------------------------------------------------------------------
    def before_rendezvous(self, ctx: AgentContext) -> None:
        if self._gated:
            return
        self._gated = True
        if self.cfg.lemon_failures <= 0:
            return
        try:
            with fleet_db(self.cfg, self.runs_root, node=self.node) as db:
                status = lemon_status(db, self.node, self.cfg)
        except FleetDBError as e:
            self.warnings += 1
            self.gate_error = str(e)
            logger.warning("fleet database: lemon check skipped, node admitted: %s", e)
            return
        except Exception as e:
            self.warnings += 1
            logger.warning("fleet database: lemon check skipped, node admitted: %s", e)
            return
        if status.ignored:
            self.warnings += 1
            logger.warning(
                "fleet database: %d record(s) of node %s not written by its role %s: not counted",
                status.ignored,
                self.node,
                self.cfg.role_of(self.node),
            )
        if not status.is_lemon:
            return
        reason = status.reason()
        ctx.events.emit(
            NODE_REFUSED,
            reason=reason,
            lemon=True,
            incidents=status.incidents,
            threshold=status.threshold,
            history=status.history,
        )
        self.writer.put(
            Record(
                node=self.node,
                kind="refused",
                cause="lemon",
                verdict="refuse",
                job=self.job,
                detail={"reason": reason, "incidents": status.incidents},
            )
        )
        raise NodeEvictedError(f"node {self.node} refused by job {self.job}: {reason} (exit 94)")

    # -- sniff tests ---------------------------------------------------------------------------
    def _load_baseline(self) -> None:
        try:
            with fleet_db(self.cfg, self.runs_root, node=self.node) as db:
                self.baseline = fleet_baseline(db, cfg=self.cfg)
        except Exception as e:  # FleetDBError or a driver's: no fleet reference this attempt
            self.warnings += 1
            logger.warning("fleet database: no sniff history to compare with: %s", e)
        if self.judge is not None:
            self.judge.baseline = dict(self.baseline)

    def on_workers_started(self, ctx: AgentContext, group: WorkerGroup) -> None:
        if self.cfg.sniff_interval_s <= 0:
            return
        self._summarize(ctx)  # what the last attempt left
        self.judge = SniffJudge(self.cfg, self.baseline)
        self._sniff_attempt = max(ctx.attempt, 0)
        self._tails = {}
        for w in group.workers:
            tail = JsonlTail(RunDir(ctx.run_dir).metrics(w.global_rank))
            try:  # skip what earlier attempts wrote
                tail.offset = tail.path.stat().st_size
            except OSError:
                pass
            self._tails[w.global_rank] = tail
        self._last_summary = time.monotonic()
        if self._baseline_loader is None:  # once per agent, off the agent's thread
            self._baseline_loader = threading.Thread(
                target=self._load_baseline, name="trainguard-fleet-baseline", daemon=True
            )
            self._baseline_loader.start()

    def on_monitor(
        self, ctx: AgentContext, group: WorkerGroup, result: RunResult
    ) -> RunResult | None:
        now = time.monotonic()
        if self.judge is None or now < self._next_poll:
            return None
        self._next_poll = now + 0.5
        found = self.poll_sniffs(ctx)
        if now - self._last_summary >= self.cfg.sniff_record_s:
            self._summarize(ctx)
        if found and self.straggler_policy == "exclude":
            reasons = [
                f"rank {f['rank']}: sniff GEMM {f['ratio']:.2f}x its {f['reference']} reference"
                for f in found
            ]
            ctx.events.emit(
                NODE_EXCLUDED,
                reason="sniff",
                reasons=reasons,
                ranks=[f["rank"] for f in found],
            )
            raise NodeUnhealthyError(f"node {ctx.events.node} excluded: " + "; ".join(reasons))
        return None

    def poll_sniffs(self, ctx: AgentContext) -> list[dict[str, Any]]:
        """Read the local ranks' new sniff records, judge them; flag and record slow ranks."""
        assert self.judge is not None
        fresh: dict[str, Any] = {}
        for r, tail in self._tails.items():
            for rec in tail.read():
                if rec.get("kind") == "sniff" and rec.get("attempt") == self._sniff_attempt:
                    self.judge.add(rec)
                    fresh[str(r)] = rec
        found = self.judge.judge(expected_ranks=len(self._tails))
        if fresh:
            ctx.events.publish(
                SNIFF_RESULTS,
                results={
                    r: {k: rec.get(k) for k in ("gemm_s", "allreduce_s", "overhead", "ratio")}
                    for r, rec in fresh.items()
                },
                flagged=sorted(q for q, st in self.judge.ranks.items() if st.flagged),
            )
        for f in found:
            msg = (
                f"rank {f['rank']} on node {ctx.events.node} became slow: its sniff GEMM took "
                f"{f['gemm_s'] * 1e3:.1f} ms, {f['ratio']:.2f}x its {f['reference']} reference "
                f"({f['reference_s'] * 1e3:.1f} ms); {f['sniffs']} of its last "
                f"{len(f['window'])} sniffs slow"
            )
            logger.warning("%s", msg)
            ctx.events.emit(SNIFF_DEGRADED, message=msg, policy=self.straggler_policy, **f)
            self.writer.put(
                Record(node=self.node, kind="sniff", cause="slow", verdict=self.straggler_policy,
                       job=self.job, attempt=self._sniff_attempt, detail={"summary": msg, **f})
            )  # fmt: skip
        return found

    def _summarize(self, ctx: AgentContext) -> None:
        """Each rank's median sniff results since the last summary, into the fleet database."""
        if self.judge is None:
            return
        for s in self.judge.take_summaries():
            self.writer.put(
                Record(node=self.node, kind="sniff", cause="slow" if s["flagged"] else "ok",
                       verdict="", job=self.job, attempt=self._sniff_attempt, detail=s)
            )  # fmt: skip
        self._last_summary = time.monotonic()

    # -- end -----------------------------------------------------------------------------------
    def on_exit(
        self, ctx: AgentContext, state: str, error: BaseException | None
    ) -> BaseException | None:
        """Flush before ``job_finished`` (the last event of the agent); the other plugins'
        exit records (an eviction) are already queued: this plugin comes after recovery's."""
        if self.judge is not None:
            try:
                self.poll_sniffs(ctx)
            except Exception as e:
                logger.debug("last sniff results not read: %s", e)
            self._summarize(ctx)
        left = self._close()
        ctx.events.emit(
            FLEET_RECORDS,
            written=self.writer.written,
            waiting=left,
            dropped=self.writer.dropped,
            warnings=self.warnings,
            error=self.writer.last_error or self.gate_error,
        )
        return None

    def close(self) -> None:
        self._close()

    def _close(self) -> int:
        if self._closed:
            return self.writer.pending
        self._closed = True
        left = self.writer.close(self.cfg.flush_timeout_s)
        if left or self.writer.dropped or self.writer.errors:
            logger.warning(
                "fleet database: %d record(s) written, %d not written, %d dropped (%s)",
                self.writer.written,
                left,
                self.writer.dropped,
                self.writer.last_error,
            )
        return left
