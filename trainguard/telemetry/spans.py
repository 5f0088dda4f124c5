"""Worker-side spans, recorded as JSON lines (no OpenTelemetry SDK in the worker).

A span costs one ``os.urandom`` and, when sampled, one JSON record appended to the rank's
metrics file; the node agent turns the records into OpenTelemetry spans and exports them.
Parentage follows the trace tree ``job → rendezvous round → attempt → step → user span``: the
agent passes the attempt span's context in ``TRAINGUARD_TRACEPARENT`` (W3C ``traceparent``).
Every span's duration, sampled or not, is summed into the step record (``spans``), which feeds
metrics such as rollout vs optimisation time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from trainguard.core.contracts import envvars

__all__ = ["TRACEPARENT_ENV", "SpanRecorder", "format_traceparent", "parse_traceparent"]

TRACEPARENT_ENV = envvars.TRACEPARENT


def parse_traceparent(value: str | None) -> tuple[str, str] | None:
    """``00-<32 hex>-<16 hex>-<flags>`` → (trace_id, span_id), or None when malformed."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        int(parts[1], 16), int(parts[2], 16)
    except ValueError:
        return None
    return parts[1], parts[2]


def format_traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


def _new_id() -> str:
    return os.urandom(8).hex()


class SpanRecorder:
    """Spans of one worker. ``write`` receives finished span records (dicts)."""

    def __init__(
        self,
        write: Callable[[dict[str, Any]], None],
        *,
        traceparent: str | None = None,
        every_n_steps: int = 10,
        base: dict[str, Any] | None = None,
    ) -> None:
        self._write = write
        parent = parse_traceparent(traceparent)
        self.root_span_id: str | None
        self.trace_id, self.root_span_id = parent if parent else (os.urandom(16).hex(), None)
        self.every_n_steps = every_n_steps
        self._base = base or {}
        self._stack: list[str] = []
        self._step_span: str | None = None
        self._sampled = True  # outside steps every span is recorded
        self.durations: dict[str, float] = {}
        """Seconds per span name since the last :meth:`take_durations`."""

    def sampled(self, step: int) -> bool:
        n = self.every_n_steps
        return n > 0 and (step < 3 or step % n == 0)

    def _parent(self) -> str | None:
        if self._stack:
            return self._stack[-1]
        return self.root_span_id

    def begin_step(self, step: int) -> tuple[str | None, float]:
        self._sampled = self.sampled(step)
        sid = _new_id() if self._sampled else None
        if sid is not None:
            self._stack.append(sid)
        self._step_span = sid
        return sid, time.time()

    def end_step(
        self, step: int, span_id: str | None, start: float, *, failed: bool = False
    ) -> None:
        if span_id is not None:
            if self._stack and self._stack[-1] == span_id:
                self._stack.pop()
            self._write_span(
                "step",
                span_id,
                self._parent(),
                start,
                time.time(),
                status="error" if failed else None,
                step=step,
            )
        self._step_span = None
        self._sampled = True

    def take_durations(self) -> dict[str, float]:
        d, self.durations = self.durations, {}
        return d

    def _write_span(
        self,
        name: str,
        span_id: str,
        parent: str | None,
        start: float,
        end: float,
        *,
        events: list[dict[str, Any]] | None = None,
        status: str | None = None,
        **attributes: object,
    ) -> None:
        rec: dict[str, Any] = {
            "time": end,
            "kind": "span",
            **self._base,
            "name": name,
            "trace_id": self.trace_id,
            "span_id": span_id,
            "parent_span_id": parent,
            "start": start,
            "end": end,
        }
        if attributes:
            rec["attributes"] = attributes
        if events:
            rec["events"] = events
        if status:
            rec["status"] = status
        self._write(rec)

    @contextmanager
    def span(self, name: str, **attributes: object) -> Iterator[None]:
        """Time a block; recorded as a span when the enclosing step is sampled."""
        t0 = time.perf_counter()
        sampled = self._sampled
        sid = _new_id() if sampled else None
        parent = self._parent()
        start = time.time()
        if sid is not None:
            self._stack.append(sid)
        error: BaseException | None = None
        try:
            yield
        except BaseException as e:
            error = e
            raise
        finally:
            dt = time.perf_counter() - t0
            self.durations[name] = self.durations.get(name, 0.0) + dt
            if sid is not None:
                if self._stack and self._stack[-1] == sid:
                    self._stack.pop()
                events = None
                if error is not None:
                    events = [
                        {
                            "name": "exception",
                            "time": time.time(),
                            "attributes": {
                                "exception.type": type(error).__name__,
                                "exception.message": str(error)[:500],
                            },
                        }
                    ]
                self._write_span(
                    name,
                    sid,
                    parent,
                    start,
                    start + dt,
                    events=events,
                    status="error" if error is not None else None,
                    **attributes,
                )
