"""Maps worker records and lifecycle events onto the contract's OpenTelemetry instruments.

The recorder is given a ``MeterProvider`` (tests pass one with an ``InMemoryMetricReader``);
it never raises into its caller: a bad record is logged and skipped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from opentelemetry.metrics import MeterProvider

from trainguard.core.contracts.event_kinds import (
    CHECKPOINT_COMMITTED,
    FAILURE_ATTRIBUTED,
    HANG_DETECTED,
    HANG_DIAGNOSIS,
    JOB_FINISHED,
    LOSS_ROLLBACK,
    NODE_REFUSED,
    PREFLIGHT,
    RENDEZVOUS,
    RESTART,
    ROLE_REPLICA_STARTED,
    ROLE_REPLICA_STATE,
    ROLLOUT_ENGINE_QUARANTINED,
    ROLLOUT_FAILED,
    ROLLOUT_REFIT_VERIFIED,
    SLURM_SCHEDULE,
    WORKER_FAILED,
    WORKERS_STARTED,
)
from trainguard.core.contracts.metrics import (
    ATTRIBUTION_CAUSES,
    HUNG_MIN_HOLD_S,
    INCIDENT_KINDS,
    LOSS_CAUSES,
    METRICS,
    NODE_STATES,
    RESTART_CAUSES,
    ROLE_STATES,
    ROLES,
    ROLLBACK_REASONS,
    ROLLOUT_FAILURE_REASONS,
    MetricSpec,
)
from trainguard.core.failures import FailureKind
from trainguard.core.goodput import Goodput
from trainguard.telemetry.mfu import PeakResolver

__all__ = ["MetricsRecorder"]

logger = logging.getLogger(__name__)

_STEP_TIME_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


_INCIDENTS = ("hang_detected", "straggler_detected", "health_unhealthy", "node_excluded")


def _incident_kind(ev: Mapping[str, Any]) -> str | None:
    kind = str(ev.get("kind"))
    if kind in _INCIDENTS:
        return kind
    if kind == PREFLIGHT and ev.get("status") not in (None, "ok"):
        return "preflight_failed"
    return None


class MetricsRecorder:
    """One per process that serves metrics (the node agent, or a test)."""

    def __init__(
        self,
        meter_provider: MeterProvider,
        *,
        node: str,
        peak: PeakResolver | None = None,
        flops_per_step: float | None = None,
        world_size: int = 1,
    ) -> None:
        self.node = node
        self.peak = peak or PeakResolver()
        self.flops_per_step = flops_per_step
        self.world_size = world_size
        meter = meter_provider.get_meter("trainguard")
        self._inst: dict[str, Any] = {}
        for spec in METRICS:
            self._inst[spec.name] = self._create(meter, spec)
        self._log_keys: list[tuple[str, MetricSpec]] = [
            (k, s) for s in METRICS for k in s.log_keys if s.kind != "histogram"
        ]
        self._devices: dict[int, str] = {}
        self._pending_cause: str | None = None
        self._hung_since: float | None = None
        self.num_bad_records = 0
        self.num_nonfinite = 0
        node_attrs = {"node": node}
        # counters start at 0 so that the first increment shows in rate()/increase()
        for kind in INCIDENT_KINDS:
            self._inst["trainguard.health.incidents"].add(0, {**node_attrs, "kind": kind})
        for cause in RESTART_CAUSES:
            self._inst["trainguard.job.restarts"].add(0, {**node_attrs, "cause": cause})
        for kind in FailureKind:
            self._inst["trainguard.job.failures"].add(0, {**node_attrs, "cause": kind.value})
        for reason in ROLLBACK_REASONS:
            self._inst["trainguard.job.rollbacks"].add(0, {**node_attrs, "reason": reason})
        for reason in ROLLOUT_FAILURE_REASONS:
            self._inst["trainguard.rl.rollout.failed"].add(0, {**node_attrs, "reason": reason})
            self._inst["trainguard.rl.rollout.retried"].add(0, {**node_attrs, "reason": reason})
        self._replica_state: dict[tuple[str, str], str] = {}
        self._roles_seen: set[str] = set()
        for cause in ATTRIBUTION_CAUSES:
            self._inst["trainguard.fleet.failures"].add(0, {**node_attrs, "cause": cause})
        self._node_states: dict[str, str] = {}
        self._hung_label = "none"
        self._set("trainguard.job.hung", 0, {**node_attrs, "diagnosis": self._hung_label})

    def _set_hung(self, value: float, diagnosis: str | None = None) -> None:
        """The hung gauge: one series per diagnosis; the previous one goes to 0."""
        node = {"node": self.node}
        if diagnosis is not None and diagnosis != self._hung_label:
            self._set("trainguard.job.hung", 0, {**node, "diagnosis": self._hung_label})
            self._hung_label = diagnosis
        self._set("trainguard.job.hung", value, {**node, "diagnosis": self._hung_label})

    @staticmethod
    def _create(meter: Any, spec: MetricSpec) -> Any:
        if spec.kind == "counter":
            return meter.create_counter(spec.name, unit=spec.unit, description=spec.description)
        if spec.kind == "histogram":
            return meter.create_histogram(
                spec.name,
                unit=spec.unit,
                description=spec.description,
                explicit_bucket_boundaries_advisory=_STEP_TIME_BUCKETS,
            )
        return meter.create_gauge(spec.name, unit=spec.unit, description=spec.description)

    def _set(self, name: str, value: float, attrs: Mapping[str, Any]) -> None:
        if not math.isfinite(value):  # a NaN loss is an event (loss_anomaly), not a gauge value
            self.num_nonfinite += 1
            return
        self._inst[name].set(value, attrs)

    # -- worker records ---------------------------------------------------------------------
    def record(self, rec: Mapping[str, Any]) -> None:
        """Feed one worker record (``kind`` step, log or span)."""
        try:
            kind = rec.get("kind")
            if kind == "step" and not rec.get("failed"):
                self._step(rec)
            elif kind == "log":
                self._log(rec)
            elif kind == "sniff":
                self._sniff(rec)
        except Exception:
            self.num_bad_records += 1
            logger.exception("skipping a metrics record that could not be mapped")

    def _sniff(self, rec: Mapping[str, Any]) -> None:
        attrs = {"rank": str(int(rec.get("rank", 0))), "node": self.node}
        for key, name in (
            ("gemm_s", "trainguard.sniff.gemm_time"),
            ("allreduce_s", "trainguard.sniff.allreduce_time"),
            ("overhead", "trainguard.sniff.overhead"),
        ):
            v = _num(rec.get(key))
            if v is not None:
                self._set(name, v, attrs)

    def sniff_slowdowns(self, results: Mapping[str, Any]) -> None:
        """``{rank: {"ratio": ...}}`` as the fleet component judged them."""
        for rank, res in results.items():
            v = _num(res.get("ratio")) if isinstance(res, Mapping) else None
            if v is not None:
                self._set("trainguard.sniff.slowdown", v, {"rank": str(rank), "node": self.node})

    def node_state(self, node: str, state: str) -> None:
        """One series per state of ``node``: the current one 1, the others 0."""
        previous = self._node_states.get(node)
        if previous == state:
            return
        self._node_states[node] = state
        for s in NODE_STATES:
            if s == state or s == previous or previous is None:
                self._set("trainguard.fleet.node.state", float(s == state),
                          {"node": node, "state": s})  # fmt: skip

    _STATE_OF = {
        "workers_started": "ok",
        "sniff_degraded": "degraded",
        "node_evicted": "evicted",
        "node_excluded": "excluded",
    }

    def _fleet_own_event(self, ev: Mapping[str, Any]) -> None:
        """This node's events in the fleet panels (attributed failures, its state) and the
        scheduler's share of the job's allocations (every node's, from the batch host)."""
        kind = str(ev.get("kind"))
        if kind == SLURM_SCHEDULE:
            self._slurm_schedule(ev)
        elif kind == FAILURE_ATTRIBUTED:
            cause = str(ev.get("cause") or "transient")
            self._inst["trainguard.fleet.failures"].add(1, {"node": self.node, "cause": cause})
        elif kind == NODE_REFUSED:
            self.fleet_event(ev)
        elif kind in self._STATE_OF:
            self.node_state(self.node, self._STATE_OF[kind])

    def fleet_event(self, ev: Mapping[str, Any]) -> None:
        """An event of any node in the run's log that the fleet panels show for that node
        (a lemon refused at a job's start: its own agent exits before a scrape)."""
        node = ev.get("node")
        if ev.get("kind") == NODE_REFUSED and ev.get("lemon") and isinstance(node, str):
            t = _num(ev.get("time"))
            if t is not None:
                self._set("trainguard.fleet.lemon.refused_time", t, {"node": node})
            self.node_state(node, "lemon")

    def _step(self, rec: Mapping[str, Any]) -> None:
        rank = int(rec.get("rank", 0))
        attrs = {"rank": str(rank), "node": self.node}
        dt = _num(rec.get("step_time_s"))
        step = _num(rec.get("step"))
        if isinstance(rec.get("device"), str):
            self._devices[rank] = rec["device"]
        if step is not None:
            self._set("trainguard.train.step", step, attrs)
        t = _num(rec.get("time"))
        if (
            self._hung_since is not None
            and t is not None
            and t > self._hung_since + HUNG_MIN_HOLD_S
        ):
            self._hung_since = None  # a step completed after the hang: the job recovered
            self._set_hung(0)
        if dt is None or dt <= 0:
            return
        self._inst["trainguard.train.step.duration"].record(dt, attrs)
        job = {"node": self.node}
        tokens = _num(rec.get("tokens"))
        if tokens is not None:
            self._set("trainguard.train.throughput", tokens / dt, attrs)
            if rank == 0:
                self._set("trainguard.job.throughput", tokens / dt * self.world_size, job)
        samples = _num(rec.get("samples"))
        if samples is not None:
            self._set("trainguard.train.sample_throughput", samples / dt, attrs)
            if rank == 0:
                self._set("trainguard.job.sample_throughput", samples / dt * self.world_size, job)
        flops = _num(rec.get("flops"))
        if flops is None:
            flops = self.flops_per_step
        if flops is not None:
            self._set("trainguard.train.flops", flops / dt, attrs)
            peak = self.peak.peak(self._devices.get(rank))
            if peak is not None:
                self._set("trainguard.train.mfu", flops / dt / peak, attrs)
        spans = rec.get("spans")
        if isinstance(spans, Mapping):
            for key, name in (
                ("rollout", "trainguard.rl.rollout.duration"),
                ("optimize", "trainguard.rl.optimize.duration"),
            ):
                v = _num(spans.get(key))
                if v is not None:
                    self._set(name, v, attrs)
        for key, name in (
            ("gpu_memory_bytes", "trainguard.gpu.memory.used"),
            ("gpu_memory_peak_bytes", "trainguard.gpu.memory.peak"),
        ):
            v = _num(rec.get(key))
            if v is not None:
                self._set(name, v, attrs)

    def _log(self, rec: Mapping[str, Any]) -> None:
        attrs = {"rank": str(int(rec.get("rank", 0))), "node": self.node}
        done: set[str] = set()
        for key, spec in self._log_keys:
            if spec.name in done or key not in rec:
                continue
            v = _num(rec[key])
            if v is not None:
                self._set(spec.name, v, attrs)
                done.add(spec.name)
        for key, name in (
            ("checkpoint_stall_s", "trainguard.checkpoint.stall.duration"),
            ("checkpoint_persist_s", "trainguard.checkpoint.persist.duration"),
        ):
            v = _num(rec.get(key))
            if v is not None:
                self._inst[name].record(v, {"node": self.node})

    # -- lifecycle events -------------------------------------------------------------------
    def _rollout_event(self, kind: str, ev: Mapping[str, Any], node: dict[str, str]) -> None:
        if kind == ROLLOUT_FAILED:
            reason = str(ev.get("reason") or "other")
            self._inst["trainguard.rl.rollout.failed"].add(1, {**node, "reason": reason})
            if ev.get("retried") is not False:  # older events did not say: retried
                self._inst["trainguard.rl.rollout.retried"].add(1, {**node, "reason": reason})
        else:  # a refit check, per engine
            name = "verified" if kind == ROLLOUT_REFIT_VERIFIED else "quarantined"
            engine = str(ev.get("engine") or "?")
            self._inst[f"trainguard.rl.refit.{name}"].add(1, {**node, "engine": engine})

    def event(self, ev: Mapping[str, Any]) -> None:
        """Feed one lifecycle event of this node (checkpoint durations come from the
        ``checkpoint_stall_s``/``checkpoint_persist_s`` log records, not from events)."""
        try:
            kind = ev.get("kind")
            node = {"node": self.node}
            if kind == WORKER_FAILED:
                cause = str(ev.get("cause") or "unknown")
                self._inst["trainguard.job.failures"].add(1, {**node, "cause": cause})
                if self._pending_cause is None and cause != "terminated":
                    self._pending_cause = cause
            elif kind in (ROLLOUT_FAILED, ROLLOUT_REFIT_VERIFIED, ROLLOUT_ENGINE_QUARANTINED):
                self._rollout_event(kind, ev, node)
            elif kind == LOSS_ROLLBACK:
                reason = str(ev.get("reason") or "other")
                self._inst["trainguard.job.rollbacks"].add(1, {**node, "reason": reason})
            elif kind == HANG_DETECTED:
                self._pending_cause = "hang"
                self._hung_since = _num(ev.get("time")) or 0.0
                self._set_hung(1, "pending")
            elif kind == HANG_DIAGNOSIS:
                if self._hung_since is None:  # another node's agent found the hang
                    self._pending_cause = "hang"
                    self._hung_since = _num(ev.get("time")) or 0.0
                self._set_hung(1, str(ev.get("diagnosis") or "unknown"))
            elif kind == JOB_FINISHED:
                self._hung_since = None
                self._set_hung(0)
            elif kind == CHECKPOINT_COMMITTED:
                t = _num(ev.get("time"))
                if t is not None:
                    self._set("trainguard.checkpoint.last_commit.time", t, node)
            elif kind == RESTART:
                cause = self._pending_cause or ev.get("reason") or "unknown"
                self._pending_cause = None
                self._inst["trainguard.job.restarts"].add(1, {**node, "cause": str(cause)})
            elif kind in (ROLE_REPLICA_STARTED, ROLE_REPLICA_STATE):
                self._role_event(ev)
            elif kind in (RENDEZVOUS, WORKERS_STARTED):
                a = _num(ev.get("attempt"))
                if a is not None:
                    self._set("trainguard.job.attempt", a, node)
            self._fleet_own_event(ev)
            incident = _incident_kind(ev)
            if incident is not None:
                self._inst["trainguard.health.incidents"].add(1, {**node, "kind": incident})
        except Exception:
            self.num_bad_records += 1
            logger.exception("skipping an event that could not be mapped")

    def _slurm_schedule(self, ev: Mapping[str, Any]) -> None:
        """The scheduler's share of one allocation of a ``trainguard sbatch`` chain."""
        alloc = {"node": self.node, "allocation": f"{ev.get('job_id')}.{ev.get('restart', 0)}"}
        for phase, key in (("queue_wait", "queue_wait_s"), ("prolog", "prolog_s"),
                           ("requeue_gap", "requeue_gap_s")):  # fmt: skip
            v = _num(ev.get(key))
            if v is not None:
                self._set("trainguard.slurm.schedule_time", v, {**alloc, "phase": phase})

    def _role_event(self, ev: Mapping[str, Any]) -> None:
        """A role replica's start or state change (trainguard.roles): the fleet gauges."""
        role, replica = str(ev.get("role") or "?"), str(ev.get("replica"))
        node = {"node": self.node, "role": role}
        if ev.get("kind") == ROLE_REPLICA_STARTED:
            if not self._roles_seen:  # exported from 0 once a fleet exists
                for r in (*ROLES, role) if role not in ROLES else ROLES:
                    self._inst["trainguard.role.restarts"].add(0, {"node": self.node, "role": r})
            self._roles_seen.add(role)
            url = ev.get("url")
            if role == "rollout" and isinstance(url, str):  # a refit check's engine (its URL)
                for check in ("verified", "quarantined"):  # exported from 0, per engine
                    self._inst[f"trainguard.rl.refit.{check}"].add(
                        0, {"node": self.node, "engine": url.rstrip("/")}
                    )
            if (_num(ev.get("restarts")) or 0) > 0:
                self._inst["trainguard.role.restarts"].add(1, node)
        total = _num(ev.get("total"))
        if total is not None:
            self._set("trainguard.role.replicas.total", total, node)
        serving = _num(ev.get("serving"))
        if serving is not None:
            self._set("trainguard.role.replicas.serving", serving, node)
        state = ev.get("state")
        if isinstance(state, str):
            rep = {**node, "replica": replica}
            previous = self._replica_state.get((role, replica))
            if previous is None:
                for s in ROLE_STATES:
                    self._set("trainguard.role.replica.state", 0, {**rep, "state": s})
            elif previous != state:
                self._set("trainguard.role.replica.state", 0, {**rep, "state": previous})
            self._replica_state[(role, replica)] = state
            self._set("trainguard.role.replica.state", 1, {**rep, "state": state})
        version = _num(ev.get("weight_version"))
        if version is not None:
            self._set(
                "trainguard.role.replica.weight_version", version, {**node, "replica": replica}
            )

    def straggler_scores(self, scores: Mapping[str, Any]) -> None:
        """``{rank: score}`` as the health component writes them."""
        for rank, score in scores.items():
            v = _num(score)
            if v is not None:
                self._set(
                    "trainguard.health.straggler_score", v, {"rank": str(rank), "node": self.node}
                )

    def run_info(self, *, run_id: str, job_id: str, slurm_job_id: str = "") -> None:
        attrs = {"node": self.node, "run_id": run_id, "job_id": job_id}
        attrs["slurm_job_id"] = slurm_job_id
        self._set("trainguard.run.info", 1, attrs)

    def goodput(self, g: Goodput) -> None:
        node = {"node": self.node}
        self._set("trainguard.goodput.productive_time", g.productive_s, node)
        for cause in LOSS_CAUSES:
            self._set(
                "trainguard.goodput.lost_time", g.lost_s.get(cause, 0.0), {**node, "cause": cause}
            )
        if g.ettr is not None:
            self._set("trainguard.goodput.ettr", g.ettr, node)

    def export_failure(self, exporter: str, n: int = 1) -> None:
        self._inst["trainguard.telemetry.export.failures"].add(
            n, {"node": self.node, "exporter": exporter}
        )
