"""The agent's trace: job → rendezvous round → worker-group attempt → step → user spans.

The job's trace id and root span id derive from the run id, so every node's agent agrees on
them without talking; only the agent of group rank 0 exports the root span. Worker spans
arrive as JSON records (see :mod:`trainguard.telemetry.spans`) and are rebuilt as
``ReadableSpan`` objects for the same span processors.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from trainguard.core.contracts.event_kinds import (
    CHECKPOINT_COMMITTED,
    RESTART,
    WORKER_GROUP_UNHEALTHY,
)
from trainguard.core.contracts.jobstate import JobState
from trainguard.telemetry.spans import format_traceparent

__all__ = ["AgentTracer", "job_ids"]

logger = logging.getLogger(__name__)
_SCOPE = InstrumentationScope("trainguard")


def job_ids(run_id: str) -> tuple[int, int]:
    """(trace_id, root span_id) derived from the run id."""
    h = hashlib.sha256(run_id.encode()).digest()
    return int.from_bytes(h[:16], "big") or 1, int.from_bytes(h[16:24], "big") or 1


class _Ids(RandomIdGenerator):
    """Random ids, except for preset ones handed out once (the job's root span)."""

    def __init__(self) -> None:
        self.trace_id: int | None = None
        self.span_id: int | None = None

    def generate_trace_id(self) -> int:
        if self.trace_id is not None:
            t, self.trace_id = self.trace_id, None
            return t
        return super().generate_trace_id()

    def generate_span_id(self) -> int:
        if self.span_id is not None:
            s, self.span_id = self.span_id, None
            return s
        return super().generate_span_id()


def _attrs(d: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (d or {}).items():
        if isinstance(v, str | bool | int | float):
            out[str(k)] = v
        elif v is not None:
            out[str(k)] = str(v)
    return out


class AgentTracer:
    """Spans of one node's agent; ``processors`` receive agent and worker spans alike."""

    def __init__(
        self, *, run_id: str, node: str, resource: Resource, processors: Sequence[SpanProcessor]
    ) -> None:
        self.node = node
        self.resource = resource
        self.processors = list(processors)
        self._ids = _Ids()
        self.provider = TracerProvider(resource=resource, id_generator=self._ids)
        for p in self.processors:
            self.provider.add_span_processor(p)
        self.tracer = self.provider.get_tracer("trainguard")
        self.trace_id, root_id = job_ids(run_id)
        self._ids.trace_id, self._ids.span_id = self.trace_id, root_id
        self.job = self.tracer.start_span(
            "trainguard.job", attributes={"trainguard.job_id": run_id, "trainguard.node": node}
        )
        self.round: trace.Span | None = None
        self.attempt: trace.Span | None = None
        self._prev_attempt: SpanContext | None = None
        self.group_rank = 0
        self._resources: dict[int, Resource] = {}
        self.local_ranks: dict[int, int | None] = {}
        """Global → local rank of this node's workers (resource attributes of their spans)."""

    # -- agent lifecycle --------------------------------------------------------------------
    def begin_round(self, *, start_time: int | None = None) -> None:
        """Open a rendezvous-round span (``start_time`` in ns when it began earlier)."""
        self.end_attempt()
        if self.round is not None:
            self.round.end()
        ctx = trace.set_span_in_context(self.job)
        self.round = self.tracer.start_span(
            "trainguard.rendezvous_round",
            context=ctx,
            attributes={"trainguard.node": self.node},
            start_time=start_time,
        )

    def begin_attempt(self, attempt: int, *, group_rank: int, world_size: int) -> str:
        """Start the attempt span; returns the ``traceparent`` for the workers."""
        self.group_rank = group_rank
        if self.round is None:
            self.begin_round()
        assert self.round is not None
        self.round.set_attribute("trainguard.attempt", attempt)
        self.round.add_event("rendezvous_complete", {"group_rank": group_rank})
        links = (
            [Link(self._prev_attempt, {"trainguard.relation": "restart_of"})]
            if (self._prev_attempt is not None)
            else []
        )
        self.attempt = self.tracer.start_span(
            "trainguard.attempt",
            context=trace.set_span_in_context(self.round),
            links=links,
            attributes={
                "trainguard.attempt": attempt,
                "trainguard.node": self.node,
                "trainguard.group_rank": group_rank,
                "trainguard.world_size": world_size,
            },
        )
        ctx = self.attempt.get_span_context()
        self._prev_attempt = ctx
        return format_traceparent(format(ctx.trace_id, "032x"), format(ctx.span_id, "016x"))

    def end_attempt(self, *, error: str | None = None) -> None:
        if self.attempt is None:
            return
        if error:
            self.attempt.set_status(Status(StatusCode.ERROR, error))
        self.attempt.end()
        self.attempt = None

    def failure(self, failures: Sequence[Any]) -> None:
        span = self.attempt or self.round or self.job
        for f in failures:
            span.add_event(
                "worker_failed",
                _attrs(
                    {
                        "rank": f.rank,
                        "cause": getattr(f.kind, "value", str(f.kind)),
                        "exitcode": f.exitcode,
                        "signal": f.signal,
                        "message": f.message,
                    }
                ),
            )
        causes = ",".join(sorted({getattr(f.kind, "value", str(f.kind)) for f in failures}))
        self.end_attempt(error=causes or "unhealthy")

    def event(self, ev: Mapping[str, Any]) -> None:
        """Recoveries and other lifecycle events become events on the job span; a committed
        checkpoint becomes ``checkpoint.stage`` + ``checkpoint.persist`` spans of the attempt."""
        kind = str(ev.get("kind"))
        if kind == CHECKPOINT_COMMITTED and self.attempt is not None:
            self._checkpoint_spans(ev)
        if (
            kind in (RESTART, WORKER_GROUP_UNHEALTHY)
            or "hang" in kind
            or kind.startswith(("checkpoint", "health", "node_"))
        ):
            fields = {k: v for k, v in ev.items() if k not in ("time", "kind")}
            target = self.round if kind == RESTART and self.round is not None else self.job
            target.add_event(kind, _attrs(fields), timestamp=int(float(ev["time"]) * 1e9))

    def _checkpoint_spans(self, ev: Mapping[str, Any]) -> None:
        assert self.attempt is not None
        end = float(ev["time"])
        persist = float(ev.get("persist_s") or 0.0) + float(ev.get("commit_s") or 0.0)
        stall = float(ev.get("stall_s") or 0.0)
        ctx = trace.set_span_in_context(self.attempt)
        attrs = _attrs({"step": ev.get("step"), "bytes": ev.get("bytes"), "path": ev.get("path")})
        attrs["trainguard.derived_from"] = "checkpoint_committed event"
        for name, t0, t1 in (
            ("checkpoint.stage", end - persist - stall, end - persist),
            ("checkpoint.persist", end - persist, end),
        ):
            span = self.tracer.start_span(
                name, context=ctx, start_time=int(t0 * 1e9), attributes=attrs
            )
            span.end(end_time=int(t1 * 1e9))

    def finish(self, state: str) -> None:
        self.end_attempt(error=None if state == JobState.SUCCEEDED else state)
        if self.round is not None:
            self.round.end()
            self.round = None
        self.job.set_attribute("trainguard.state", state)
        if state != JobState.SUCCEEDED:
            self.job.set_status(Status(StatusCode.ERROR, state))
        if self.group_rank == 0:
            self.job.end()

    # -- worker spans -----------------------------------------------------------------------
    def _worker_resource(self, rank: int) -> Resource:
        r = self._resources.get(rank)
        if r is None:
            attrs: dict[str, Any] = {"trainguard.rank": rank}
            if self.local_ranks.get(rank) is not None:
                attrs["trainguard.local_rank"] = self.local_ranks[rank]
            r = self.resource.merge(Resource(attrs))
            self._resources[rank] = r
        return r

    def worker_span(self, rec: Mapping[str, Any]) -> None:
        """Rebuild a worker's span record and hand it to the processors."""
        try:
            trace_id = int(rec["trace_id"], 16)
            ctx = SpanContext(
                trace_id, int(rec["span_id"], 16), is_remote=False, trace_flags=TraceFlags(1)
            )
            parent = None
            if rec.get("parent_span_id"):
                parent = SpanContext(
                    trace_id,
                    int(rec["parent_span_id"], 16),
                    is_remote=True,
                    trace_flags=TraceFlags(1),
                )
            attrs = _attrs(rec.get("attributes"))
            attrs["trainguard.rank"] = int(rec.get("rank", 0))
            attrs["trainguard.attempt"] = int(rec.get("attempt", 0))
            events = [
                Event(
                    str(e.get("name")),
                    _attrs(e.get("attributes")),
                    int(float(e.get("time", rec["end"])) * 1e9),
                )
                for e in rec.get("events") or ()
            ]
            status = Status(StatusCode.ERROR) if rec.get("status") == "error" else Status()
            span = ReadableSpan(
                name=str(rec["name"]),
                context=ctx,
                parent=parent,
                resource=self._worker_resource(int(rec.get("rank", 0))),
                attributes=attrs,
                events=events,
                kind=SpanKind.INTERNAL,
                status=status,
                start_time=int(float(rec["start"]) * 1e9),
                end_time=int(float(rec["end"]) * 1e9),
                instrumentation_scope=_SCOPE,
            )
        except (KeyError, TypeError, ValueError):
            logger.debug("skipping a malformed span record: %r", rec)
            return
        for p in self.processors:
            try:
                p.on_end(span)
            except Exception:
                logger.exception("span processor failed")

    def shutdown(self) -> None:
        self.provider.shutdown()
