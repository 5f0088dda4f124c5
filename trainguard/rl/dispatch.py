"""The rollout client's batch dispatch: one :meth:`RolloutClient.generate` call split into
requests, each sent to the engine table's pick, its answer parsed by the engine contract's one
completion parser and checked against the staleness bound; a failed request is counted and
retried on another engine, or the batch fails with :class:`RolloutError`. Never a made-up
sample: every completion returned is a real engine's answer that met the contract."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from trainguard.core.contracts.engine import (
    COMPLETIONS_PATH,
    MALFORMED,
    MalformedAnswer,
    identity_mismatch,
    parse_completion,
)
from trainguard.core.contracts.engine import Identity as _Identity
from trainguard.core.contracts.event_kinds import ROLLOUT_FAILED
from trainguard.rl.rollout_types import Completion, RolloutConfig, RolloutError
from trainguard.rl.routing import EngineRecord, EngineTable, RequestFailure
from trainguard.rl.sampling import request_seed

__all__ = ["Batch", "BatchDispatcher", "RolloutCounters", "request_params"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RolloutCounters:
    """Failures, retries, latency and tokens: cumulative and since the last
    :meth:`RolloutClient.take_metrics`."""

    failures: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    latencies: list[float] = field(default_factory=list)
    interval_failures: Counter[str] = field(default_factory=Counter)
    interval_retries: int = 0
    tokens: int = 0
    gen_s: float = 0.0

    def failed(self, reason: str) -> None:
        self.failures[reason] += 1
        self.interval_failures[reason] += 1

    def retried(self) -> None:
        self.retries += 1
        self.interval_retries += 1


@dataclass(slots=True)
class _Chunk:
    indices: list[int]
    attempts: int = 0
    tried: set[str] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)


class _Flight(NamedTuple):
    """A request in flight: what it asks, where it went, when, under which versions."""

    chunk: _Chunk
    engine: EngineRecord
    epoch: int
    """The engine's epoch when it was sent (a newer one: the engine died meanwhile)."""
    t0: float
    policy_version: int | None


def request_params(
    n: int, max_tokens: int, temperature: float, top_p: float, logprobs: bool
) -> dict[str, Any]:
    """The ``/v1/completions`` fields every request of a batch shares."""
    params: dict[str, Any] = {
        "n": n,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
    }
    if logprobs:
        params["logprobs"] = 0
    return params


@dataclass(slots=True)
class Batch:
    """One :meth:`RolloutClient.generate` call: its requests waiting, in flight and done."""

    prompts: list[str]
    params: dict[str, Any]
    n: int
    seed: int | list[int] | None
    """An int: prompt ``i`` of the batch is seeded ``request_seed(seed, i)``; a list: one
    per prompt."""
    chunk_size: int
    deadline: float
    todo: list[_Chunk] = field(default_factory=list)
    inflight: dict[Future[Any], _Flight] = field(default_factory=dict)
    results: dict[int, list[Completion]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        k, total = self.chunk_size, len(self.prompts)
        self.todo = [_Chunk(list(range(i, min(i + k, total)))) for i in range(0, total, k)]

    def body(self, chunk: _Chunk) -> dict[str, Any]:
        b: dict[str, Any] = {"prompt": [self.prompts[i] for i in chunk.indices], **self.params}
        if isinstance(self.seed, list):
            b["seed"] = [self.seed[i] for i in chunk.indices]
        elif self.seed is not None:  # the same seeds however the batch is cut into requests
            b["seed"] = [request_seed(self.seed, i) for i in chunk.indices]
        return b


class BatchDispatcher:
    """Runs batches over an :class:`EngineTable` (see the module docstring)."""

    def __init__(
        self,
        table: EngineTable,
        pool: ThreadPoolExecutor,
        config: RolloutConfig,
        counters: RolloutCounters,
        emit: Callable[..., None],
    ) -> None:
        self.table = table
        self.pool = pool
        self.config = config
        self.counters = counters
        self.emit = emit

    def run(self, batch: Batch) -> list[list[Completion]]:
        t_batch = time.perf_counter()
        lock = self.table.lock
        try:
            while batch.todo or batch.inflight:
                self._dispatch(batch)
                self._check_deadline(batch)
                done = self._wait_any(batch)
                with lock:
                    self._collect(batch, done)
                    self._abandon_dead(batch)
        except BaseException:
            with lock:
                for flight in batch.inflight.values():
                    flight.engine.inflight -= 1
            raise
        self.counters.gen_s += time.perf_counter() - t_batch
        return [batch.results[i] for i in range(len(batch.prompts))]

    def _dispatch(self, batch: Batch) -> None:
        """Send every waiting request of ``batch`` to the least-loaded routable engine (the
        ones left wait for an engine to become routable)."""
        with self.table.lock:
            while batch.todo:
                eng = self.table.pick(batch.todo[0].tried)
                if eng is None:
                    return
                chunk = batch.todo.pop(0)
                chunk.attempts += 1
                chunk.tried.add(eng.url)
                eng.inflight += 1
                fut = self.pool.submit(
                    self.table.call,
                    eng,
                    "POST",
                    COMPLETIONS_PATH,
                    batch.body(chunk),
                    self.config.request_timeout_s,
                )
                batch.inflight[fut] = _Flight(
                    chunk, eng, eng.epoch, time.perf_counter(), self.table.policy_version
                )

    def _check_deadline(self, batch: Batch) -> None:
        if time.monotonic() > batch.deadline:
            raise RolloutError(
                f"batch of {len(batch.prompts)} prompts not complete after "
                f"{self.config.batch_timeout_s:.0f} s; engines: {self.table.summary()}"
            )

    def _wait_any(self, batch: Batch) -> set[Future[Any]]:
        """The requests that finished within a short wait (none when nothing is in flight:
        no engine was routable, so wait for the health probes)."""
        if batch.inflight:
            done, _ = wait(list(batch.inflight), timeout=0.2, return_when=FIRST_COMPLETED)
            return done
        with self.table.lock:
            self.table.lock.wait(0.2)
        return set()

    def _collect(self, batch: Batch, done: set[Future[Any]]) -> None:
        """Keep the finished requests' completions; a failed or incomplete answer is retried
        (under the lock)."""
        for fut in done:
            flight = batch.inflight.pop(fut)
            chunk, eng = flight.chunk, flight.engine
            eng.inflight -= 1
            try:
                got = self._accept(fut.result(), chunk, eng, batch.n, self.table.policy_version)
            except RequestFailure as f:
                self._retry(batch, chunk, eng, f.reason, f.detail)
                continue
            except Exception as e:  # never out of generate(): a counted, retried failure
                self._retry(batch, chunk, eng, MALFORMED, f"{type(e).__name__}: {e}")
                continue
            eng.request_failures = 0
            self.counters.latencies.append(time.perf_counter() - flight.t0)
            for i, comps in zip(chunk.indices, got, strict=False):
                batch.results[i] = comps
                self.counters.tokens += sum(len(c.token_ids) for c in comps)

    def _abandon_dead(self, batch: Batch) -> None:
        """Retry at once the requests in flight on an engine declared dead (or replaced by a
        new process) since they were sent (under the lock)."""
        for fut, flight in list(batch.inflight.items()):
            if flight.engine.epoch != flight.epoch:
                batch.inflight.pop(fut)
                flight.engine.inflight -= 1
                self._retry(
                    batch,
                    flight.chunk,
                    flight.engine,
                    "engine_dead",
                    "declared dead with the request in flight",
                )

    def _retry(
        self, batch: Batch, chunk: _Chunk, eng: EngineRecord, reason: str, detail: str
    ) -> None:
        """Count the failure and queue the request again, or raise :class:`RolloutError` when
        it is invalid (HTTP 4xx) or out of attempts."""
        final = reason == "http_4xx" or chunk.attempts >= self.config.max_attempts
        self._fail(eng, reason, detail, retried=not final)
        chunk.reasons.append(f"{eng.url}: {reason}")
        if reason == "http_4xx":
            raise RolloutError(f"an engine refused the request as invalid: {detail}")
        if chunk.attempts >= self.config.max_attempts:
            if self.config.drop_failed_groups and reason != "unauthorized":
                for i in chunk.indices:  # no member: the caller drops these groups whole
                    batch.results[i] = []
                return
            raise RolloutError(
                f"prompts {chunk.indices[0]}..{chunk.indices[-1]}: no real generation after "
                f"{chunk.attempts} attempts ({'; '.join(chunk.reasons)})"
                + (f"; {self.table.auth_error}" if reason == "unauthorized" else "")
            )
        self.counters.retried()
        batch.todo.append(chunk)

    def _fail(self, eng: EngineRecord, reason: str, detail: str, *, retried: bool) -> None:
        self.counters.failed(reason)
        self.table.note_failure(eng, reason)
        logger.warning("rollout request to %s failed (%s): %s", eng.url, reason, detail)
        self.emit(
            ROLLOUT_FAILED, reason=reason, engine=eng.url, retried=retried, detail=detail[:300]
        )

    def _accept(
        self, raw: bytes, chunk: _Chunk, eng: EngineRecord, n: int, pv: int | None
    ) -> list[list[Completion]]:
        """The answer's completions, checked by the contract's parser; RequestFailure
        otherwise."""
        want = len(chunk.indices) * n
        try:
            answer = parse_completion(raw, expected=want, vocab_size=self.table.vocab_size(eng))
        except MalformedAnswer as e:
            raise RequestFailure(MALFORMED, e.detail) from None
        if answer.incarnation is not None and eng.incarnation is not None:
            wrong = identity_mismatch(
                _Identity(None, answer.incarnation), _Identity(None, eng.incarnation)
            )
            if wrong is not None:
                raise RequestFailure("engine_dead", f"answered by another process: {wrong}")
        version = answer.weight_version
        if pv is not None and not pv - self.config.max_staleness <= version <= pv:
            raise RequestFailure("stale", f"generated by version {version}, trainer at {pv}")
        out: list[list[Completion]] = [[] for _ in chunk.indices]
        for c in answer.choices:  # sorted by index, one per index
            out[c.index // n].append(
                Completion(
                    prompt_index=chunk.indices[c.index // n],
                    text=c.text,
                    token_ids=c.token_ids,
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                    weight_version=version,
                    staleness=(pv - version) if pv is not None else 0,
                    engine=eng.url,
                )
            )
        return out
