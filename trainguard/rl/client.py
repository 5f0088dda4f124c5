"""The trainer's rollout client: prompts in, real generations out, or an explicit error.

``RolloutClient`` talks to a fleet of engines that speak the engine contract
(:mod:`trainguard.rl.engine`). It

- routes each request to the least-loaded routable engine: one that last reported
  ``serving`` with a weight version within the staleness bound of the trainer's version
  (``policy_version - max_staleness <= version <= policy_version``);
- retries a failed request on another engine (an error, a timeout, a refused connection,
  HTTP 5xx, a malformed or incomplete answer, a version outside the bound), at most
  ``max_attempts`` times per request; a batch is complete with real generations, or
  :class:`RolloutError` is raised: a failed generation is never replaced by a placeholder,
  an empty or a zero-reward completion;
- probes every engine's ``/health`` in the background: a refused connection takes an engine
  out of routing at once, a probe that times out ``dead_after_failures`` times in a row
  (``health_interval_s`` apart, ``health_timeout_s`` each: about 6 s by default, within 10 s)
  declares it dead, and requests in flight on it are retried elsewhere at once;
- pushes weight versions (:meth:`sync_weights`) to every live engine in parallel under a
  timeout derived from the measured sync times; an engine that does not confirm leaves
  routing until its health reports the new version (it refits itself from the weight store).

Failures are counted by reason (:data:`FAILURE_REASONS`), retries counted, request latency
recorded; :meth:`take_metrics` returns the figures of the last interval for ``tg.log``, and
``events`` (e.g. ``tg.events.emit``) receives one ``rollout_failed`` event per failure.

Engine states as the client sees them (:class:`EngineState`)::

    UNKNOWN → LOADING → SERVING ⇄ SUSPECT → DEAD → (restarted) LOADING → SERVING
                         SERVING ⇄ STALE (version outside the bound; back after a refit)
"""

from __future__ import annotations

import enum
import http.client
import json
import logging
import os
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from trainguard.core import envvars
from trainguard.core.contract import ROLLOUT_FAILURE_REASONS
from trainguard.core.event_kinds import ROLLOUT_ENGINE_QUARANTINED, ROLLOUT_REFIT_VERIFIED
from trainguard.rl.sampling import request_seed
from trainguard.rl.verify import compare, fingerprint_request

__all__ = [
    "FAILURE_REASONS",
    "Completion",
    "EngineState",
    "RolloutClient",
    "RolloutConfig",
    "RolloutError",
    "SyncResult",
    "urls_from_env",
]

logger = logging.getLogger(__name__)

ROLLOUT_URLS_ENV = envvars.ROLLOUT_URLS
REWARD_URLS_ENV = envvars.REWARD_URLS

FAILURE_REASONS = ROLLOUT_FAILURE_REASONS
"""Why a rollout request failed (see :data:`trainguard.core.contract.ROLLOUT_FAILURE_REASONS`)."""


class RolloutError(RuntimeError):
    """A batch could not be completed with real generations within its caps."""


class EngineState(enum.Enum):
    UNKNOWN = "unknown"
    LOADING = "loading"
    SERVING = "serving"
    STALE = "stale"
    SUSPECT = "suspect"
    DEAD = "dead"
    QUARANTINED = "quarantined"
    """Its weights failed a refit check (:mod:`trainguard.rl.verify`): out of routing until
    a refit is verified."""


def urls_from_env(name: str = ROLLOUT_URLS_ENV) -> list[str]:
    raw = os.environ.get(name, "")
    return [u.strip().rstrip("/") for u in raw.split(",") if u.strip()]


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    max_staleness: int = 0
    """Versions of lag a sample may have: 0 = on-policy, k = async with k versions of lag."""
    request_timeout_s: float = 60.0
    """No answer from an engine in this time: the request fails (``timeout``) and is retried."""
    max_attempts: int = 4
    """Attempts per request (the first one included) before the batch fails."""
    batch_timeout_s: float = 600.0
    """A batch not complete in this time raises :class:`RolloutError`."""
    prompts_per_request: int = 4
    """Prompts of a batch sent in one request (each with its ``n`` completions)."""
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    dead_after_failures: int = 2
    """Consecutive failed probes (timeouts, errors) that declare an engine dead."""
    failure_cooldown_s: float = 2.0
    """An engine whose request failed gets no request for this long, doubled for each further
    failure in a row (up to ``failure_cooldown_max_s``; an answer resets it): the retries of a
    batch are spread over the time a faulty engine needs to recover or be replaced, rather
    than spent on it within seconds."""
    failure_cooldown_max_s: float = 16.0
    sync_timeout_initial_s: float = 60.0
    """Weight-sync timeout before any sync was measured."""
    sync_timeout_factor: float = 5.0
    sync_timeout_min_s: float = 3.0
    """Sync timeout = max(min, factor × median of the measured sync times)."""
    refit_attempts: int = 3
    """Refits of an engine whose refit failed its check (quarantined) within one sync."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness}: give 0 (on-policy) or more")
        if self.max_attempts < 1 or self.prompts_per_request < 1:
            raise ValueError("max_attempts and prompts_per_request must be at least 1")
        if min(self.request_timeout_s, self.health_interval_s, self.health_timeout_s) <= 0:
            raise ValueError("timeouts and intervals must be positive")


@dataclass(frozen=True, slots=True)
class Completion:
    """One real generation."""

    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    weight_version: int
    staleness: int
    """The trainer's policy version when the answer arrived − the version that generated it
    (within ``0..max_staleness``)."""
    engine: str


@dataclass(frozen=True, slots=True)
class SyncResult:
    version: int
    duration_s: float
    timeout_s: float
    confirmed: list[str]
    missed: list[str]


@dataclass(slots=True)
class _Engine:
    url: str
    host: str
    port: int
    state: EngineState = EngineState.UNKNOWN
    version: int | None = None
    inflight: int = 0
    reported_inflight: int = 0
    probe_failures: int = 0
    request_failures: int = 0
    """Failed requests in a row (reset by a good answer): the cooldown doubles with each."""
    cooldown_until: float = 0.0
    epoch: int = 0
    """Bumped when the engine is declared dead: requests of an older epoch are abandoned."""
    pid: int | None = None
    verified: tuple[int | None, int] | None = None
    """(pid, version) this client last verified (with a fingerprint source)."""
    checking: bool = False


class _Failure(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(slots=True)
class _Chunk:
    indices: list[int]
    attempts: int = 0
    tried: set[str] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)


class _Flight(NamedTuple):
    """A request in flight: what it asks, where it went, when, under which versions."""

    chunk: _Chunk
    engine: _Engine
    epoch: int
    """The engine's epoch when it was sent (a newer one: the engine died meanwhile)."""
    t0: float
    policy_version: int | None


def _request_params(
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
class _Batch:
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


class RolloutClient:
    """See the module docstring. ``urls`` default to ``$TRAINGUARD_ROLLOUT_URLS``."""

    def __init__(
        self,
        urls: Sequence[str] | None = None,
        *,
        config: RolloutConfig | None = None,
        events: Callable[..., Any] | None = None,
        start: bool = True,
        fingerprints: Callable[[int], dict[str, Any] | None] | None = None,
    ) -> None:
        """``fingerprints``: the trainer's fingerprint of a weight version (e.g.
        ``lambda v: store.meta(v).get("fingerprint")``); given, an engine is routed version
        ``v`` only once its answers matched it (:mod:`trainguard.rl.verify`), and one that
        does not match is quarantined and refit."""
        urls = list(urls) if urls is not None else urls_from_env()
        if not urls:
            raise ValueError(
                f"no rollout engines: pass urls or set {ROLLOUT_URLS_ENV} "
                "(trainguard run sets it for a job with a rollout role)"
            )
        self.config = config or RolloutConfig()
        self._events = events
        self._fingerprints = fingerprints
        self.refits_verified: Counter[str] = Counter()
        self.refits_quarantined: Counter[str] = Counter()
        self._engines: dict[str, _Engine] = {}
        for u in urls:
            parts = urlsplit(u.rstrip("/"))
            if parts.scheme != "http" or not parts.hostname or not parts.port:
                raise ValueError(f"rollout engine URL {u!r}: expected http://HOST:PORT")
            self._engines[u.rstrip("/")] = _Engine(u.rstrip("/"), parts.hostname, parts.port)
        self._lock = threading.Condition()
        self.policy_version: int | None = None
        self._pool = ThreadPoolExecutor(
            max_workers=max(8, 4 * len(urls)), thread_name_prefix="rollout"
        )
        self._probe_pool = ThreadPoolExecutor(
            max_workers=len(urls), thread_name_prefix="rollout-health"
        )
        self._stop = threading.Event()
        self._sync_times: list[float] = []
        # metrics: cumulative and since the last take_metrics()
        self.failures: Counter[str] = Counter()
        self.retries = 0
        self._m_latencies: list[float] = []
        self._m_failures: Counter[str] = Counter()
        self._m_retries = 0
        self._m_tokens = 0
        self._m_gen_s = 0.0
        self._health: threading.Thread | None = None
        if start:
            self.start()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._health is None:
            self._probe_all()
            self._health = threading.Thread(
                target=self._health_loop, name="rollout-health", daemon=True
            )
            self._health.start()

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._probe_pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- HTTP --------------------------------------------------------------------------------
    def _http(self, eng: _Engine, method: str, path: str, body: Any, timeout: float) -> Any:
        conn = http.client.HTTPConnection(eng.host, eng.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except ConnectionRefusedError as e:
            raise _Failure("refused", str(e)) from None
        except TimeoutError as e:
            raise _Failure("timeout", f"no answer in {timeout:.1f} s ({e})") from None
        except (OSError, http.client.HTTPException) as e:
            raise _Failure("connection", f"{type(e).__name__}: {e}") from None
        finally:
            conn.close()
        if resp.status == 503:
            raise _Failure("not_serving", raw[:200].decode(errors="replace"))
        if resp.status >= 500:
            raise _Failure("http_5xx", f"HTTP {resp.status}: {raw[:200].decode(errors='replace')}")
        if resp.status >= 400:
            raise _Failure("http_4xx", f"HTTP {resp.status}: {raw[:300].decode(errors='replace')}")
        try:
            return json.loads(raw)
        except ValueError as e:
            raise _Failure("malformed", f"not JSON ({e})") from None

    # -- health ------------------------------------------------------------------------------
    def _routable(self, eng: _Engine, now: float) -> bool:
        return (
            eng.state is EngineState.SERVING
            and now >= eng.cooldown_until
            and self._in_bound(eng.version)
        )

    def _in_bound(self, version: int | None) -> bool:
        if version is None:
            return False
        pv = self.policy_version
        return pv is None or pv - self.config.max_staleness <= version <= pv

    def _mark_dead(self, eng: _Engine, why: str) -> None:
        if eng.state is not EngineState.DEAD:
            logger.warning("rollout engine %s is dead: %s", eng.url, why)
        eng.state = EngineState.DEAD
        eng.epoch += 1
        eng.version = None

    def _probe(self, eng: _Engine) -> None:
        try:
            h = self._http(eng, "GET", "/health", None, self.config.health_timeout_s)
            if not isinstance(h, dict):
                raise _Failure("malformed", "health is not a JSON object")
        except _Failure as f:
            with self._lock:
                if f.reason == "refused":
                    self._mark_dead(eng, "connection refused")
                else:
                    eng.probe_failures += 1
                    if eng.probe_failures >= self.config.dead_after_failures:
                        self._mark_dead(eng, f"{eng.probe_failures} failed health probes ({f})")
                    elif eng.state is not EngineState.DEAD:
                        eng.state = EngineState.SUSPECT
                self._lock.notify_all()
            return
        with self._lock:
            eng.probe_failures = 0
            pid = h.get("pid")
            status = h.get("status")
            version = h.get("weight_version")
            eng.reported_inflight = int(h.get("inflight") or 0)
            if eng.pid is not None and pid is not None and pid != eng.pid:
                eng.epoch += 1  # a new process behind the same port: old requests are gone
            eng.pid = pid if isinstance(pid, int) else eng.pid
            eng.version = version if isinstance(version, int) else None
            check = False
            if status == "quarantined":
                eng.state = EngineState.QUARANTINED
            elif status == "serving" and eng.version is not None:
                check = self._needs_check(eng)
                eng.state = (
                    EngineState.LOADING
                    if check
                    else EngineState.SERVING
                    if self._in_bound(eng.version)
                    else EngineState.STALE
                )
            else:
                eng.state = EngineState.LOADING
            self._lock.notify_all()
        if check and eng.version is not None:  # a version it loaded by itself: checked first
            self._check_refit(eng, eng.version)

    def _probe_all(self) -> None:
        futures = [self._probe_pool.submit(self._probe, e) for e in self._engines.values()]
        wait(futures, timeout=self.config.health_timeout_s + 1)

    def _health_loop(self) -> None:
        while not self._stop.wait(self.config.health_interval_s):
            try:
                self._probe_all()
            except RuntimeError:  # the pool was shut down: closing
                return

    def engines(self) -> dict[str, dict[str, Any]]:
        """Each engine's state as the client sees it."""
        with self._lock:
            return {
                u: {"state": e.state.value, "version": e.version, "inflight": e.inflight}
                for u, e in self._engines.items()
            }

    def num_serving(self) -> int:
        now = time.monotonic()
        with self._lock:
            return sum(self._routable(e, now) for e in self._engines.values())

    def wait_serving(self, min_engines: int = 1, timeout: float = 120.0) -> int:
        """Block until ``min_engines`` are routable; their number. RolloutError at timeout."""
        deadline = time.monotonic() + timeout
        while True:
            n = self.num_serving()
            if n >= min_engines:
                return n
            if time.monotonic() > deadline:
                raise RolloutError(
                    f"{n} of {len(self._engines)} engines serving after {timeout:.0f} s: {self.engines()}"
                )
            with self._lock:
                self._lock.wait(0.2)

    # -- generation --------------------------------------------------------------------------
    def _pick(self, chunk: _Chunk) -> _Engine | None:
        now = time.monotonic()
        ok = [e for e in self._engines.values() if self._routable(e, now)]
        if not ok:
            return None
        fresh = [e for e in ok if e.url not in chunk.tried] or ok
        return min(fresh, key=lambda e: (e.inflight, e.reported_inflight, e.url))

    def _fail(self, eng: _Engine, reason: str, detail: str, *, retried: bool = True) -> None:
        self.failures[reason] += 1
        self._m_failures[reason] += 1
        cfg = self.config
        eng.request_failures += 1
        cooldown = cfg.failure_cooldown_s * 2 ** min(eng.request_failures - 1, 16)
        eng.cooldown_until = time.monotonic() + min(cooldown, cfg.failure_cooldown_max_s)
        if reason == "refused":
            self._mark_dead(eng, "connection refused")
        elif reason in ("timeout", "connection", "http_5xx", "malformed", "not_serving"):
            if eng.state is EngineState.SERVING:
                eng.state = EngineState.SUSPECT
        elif reason == "stale" and eng.state is EngineState.SERVING:
            eng.state = EngineState.STALE
        logger.warning("rollout request to %s failed (%s): %s", eng.url, reason, detail)
        self._emit(
            "rollout_failed", reason=reason, engine=eng.url, retried=retried, detail=detail[:300]
        )

    def _emit(self, kind: str, **fields: Any) -> None:
        if self._events is not None:
            try:
                self._events(kind, **fields)
            except Exception:  # telemetry never stops the rollout
                logger.exception("could not record a %s event", kind)

    def generate(
        self,
        prompts: Sequence[str],
        *,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        logprobs: bool = False,
        seed: int | Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """``n`` real completions for each prompt (outer list in prompt order), or
        :class:`RolloutError` after ``max_attempts`` failed attempts of one request or
        ``batch_timeout_s``. An HTTP 4xx (the request itself is bad) raises at once.

        ``seed``: reproducible sampling (:mod:`trainguard.rl.sampling`): one seed per prompt
        (e.g. :func:`~trainguard.rl.sampling.prompt_seed` of the run's seed, the epoch and
        the prompt's id), or an int ``s`` seeding prompt ``i`` with
        :func:`~trainguard.rl.sampling.request_seed` ``(s, i)``. Sample ``j``
        of a prompt seeded ``t`` draws from the stream ``t + j``, whichever engine serves it
        and whatever else it generates at the same time."""
        if not prompts:
            return []
        if seed is not None and not isinstance(seed, int):
            seed = [int(x) for x in seed]
            if len(seed) != len(prompts):
                raise ValueError(f"{len(seed)} seeds for {len(prompts)} prompts: give one each")
        batch = _Batch(
            prompts=list(prompts),
            params=_request_params(n, max_tokens, temperature, top_p, logprobs),
            n=n,
            seed=seed,
            chunk_size=self.config.prompts_per_request,
            deadline=time.monotonic() + self.config.batch_timeout_s,
        )
        t_batch = time.perf_counter()
        try:
            while batch.todo or batch.inflight:
                self._dispatch(batch)
                self._check_deadline(batch)
                done = self._wait_any(batch)
                with self._lock:
                    self._collect(batch, done)
                    self._abandon_dead(batch)
        except BaseException:
            with self._lock:
                for flight in batch.inflight.values():
                    flight.engine.inflight -= 1
            raise
        self._m_gen_s += time.perf_counter() - t_batch
        return [batch.results[i] for i in range(len(batch.prompts))]

    def _dispatch(self, batch: _Batch) -> None:
        """Send every waiting request of ``batch`` to the least-loaded routable engine (the
        ones left wait for an engine to become routable)."""
        with self._lock:
            while batch.todo:
                eng = self._pick(batch.todo[0])
                if eng is None:
                    return
                chunk = batch.todo.pop(0)
                chunk.attempts += 1
                chunk.tried.add(eng.url)
                eng.inflight += 1
                fut = self._pool.submit(
                    self._http,
                    eng,
                    "POST",
                    "/v1/completions",
                    batch.body(chunk),
                    self.config.request_timeout_s,
                )
                batch.inflight[fut] = _Flight(
                    chunk, eng, eng.epoch, time.perf_counter(), self.policy_version
                )

    def _check_deadline(self, batch: _Batch) -> None:
        if time.monotonic() > batch.deadline:
            raise RolloutError(
                f"batch of {len(batch.prompts)} prompts not complete after "
                f"{self.config.batch_timeout_s:.0f} s; engines: {self.engines()}"
            )

    def _wait_any(self, batch: _Batch) -> set[Future[Any]]:
        """The requests that finished within a short wait (none when nothing is in flight:
        no engine was routable, so wait for the health probes)."""
        if batch.inflight:
            done, _ = wait(list(batch.inflight), timeout=0.2, return_when=FIRST_COMPLETED)
            return done
        with self._lock:
            self._lock.wait(0.2)
        return set()

    def _collect(self, batch: _Batch, done: set[Future[Any]]) -> None:
        """Keep the finished requests' completions; a failed or incomplete answer is retried
        (under the lock)."""
        for fut in done:
            flight = batch.inflight.pop(fut)
            chunk, eng = flight.chunk, flight.engine
            eng.inflight -= 1
            try:
                got = self._accept(fut.result(), chunk, eng, batch.n, self.policy_version)
            except _Failure as f:
                self._retry(batch, chunk, eng, f.reason, str(f))
                continue
            eng.request_failures = 0
            self._m_latencies.append(time.perf_counter() - flight.t0)
            for i, comps in zip(chunk.indices, got, strict=False):
                batch.results[i] = comps
                self._m_tokens += sum(len(c.token_ids) for c in comps)

    def _abandon_dead(self, batch: _Batch) -> None:
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

    def _retry(self, batch: _Batch, chunk: _Chunk, eng: _Engine, reason: str, detail: str) -> None:
        """Count the failure and queue the request again, or raise :class:`RolloutError` when
        it is invalid (HTTP 4xx) or out of attempts."""
        final = reason == "http_4xx" or chunk.attempts >= self.config.max_attempts
        self._fail(eng, reason, detail, retried=not final)
        chunk.reasons.append(f"{eng.url}: {reason}")
        if reason == "http_4xx":
            raise RolloutError(f"an engine refused the request as invalid: {detail}")
        if chunk.attempts >= self.config.max_attempts:
            raise RolloutError(
                f"prompts {chunk.indices[0]}..{chunk.indices[-1]}: no real generation after "
                f"{chunk.attempts} attempts ({'; '.join(chunk.reasons)})"
            )
        self.retries += 1
        self._m_retries += 1
        batch.todo.append(chunk)

    def _accept(
        self, answer: Any, chunk: _Chunk, eng: _Engine, n: int, pv: int | None
    ) -> list[list[Completion]]:
        """The answer's completions, checked complete; _Failure otherwise."""
        if not isinstance(answer, dict):
            raise _Failure("malformed", "the answer is not a JSON object")
        choices = answer.get("choices")
        version = answer.get("weight_version")
        want = len(chunk.indices) * n
        if not isinstance(choices, list) or len(choices) != want:
            got = len(choices) if isinstance(choices, list) else type(choices).__name__
            raise _Failure("malformed", f"{got} choices for {want} requested")
        if not isinstance(version, int):
            raise _Failure("malformed", "the answer names no weight_version")
        if pv is not None and not pv - self.config.max_staleness <= version <= pv:
            raise _Failure("stale", f"generated by version {version}, trainer at {pv}")
        out: list[list[Completion]] = [[] for _ in chunk.indices]
        for c in sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0):
            if not isinstance(c, dict) or not isinstance(c.get("text"), str):
                raise _Failure("malformed", "a choice without text")
            idx = c.get("index")
            ids = c.get("token_ids")
            if not isinstance(idx, int) or not 0 <= idx < want or not isinstance(ids, list):
                raise _Failure("malformed", "a choice without a valid index or token_ids")
            lp = c.get("logprobs")
            lps = lp.get("token_logprobs") if isinstance(lp, dict) else None
            out[idx // n].append(
                Completion(
                    prompt_index=chunk.indices[idx // n],
                    text=c["text"],
                    token_ids=[int(t) for t in ids],
                    logprobs=[float(x) for x in lps] if isinstance(lps, list) else None,
                    finish_reason=str(c.get("finish_reason")),
                    weight_version=version,
                    staleness=(pv - version) if pv is not None else 0,
                    engine=eng.url,
                )
            )
        if any(len(group) != n for group in out):
            raise _Failure("malformed", "choices do not cover every prompt n times")
        return out

    # -- weight sync -------------------------------------------------------------------------
    def sync_timeout_s(self) -> float:
        cfg = self.config
        if not self._sync_times:
            return cfg.sync_timeout_initial_s
        return max(
            cfg.sync_timeout_min_s,
            cfg.sync_timeout_factor * statistics.median(self._sync_times[-20:]),
        )

    def set_policy_version(self, version: int) -> None:
        """The trainer's current version (engines outside the bound leave routing)."""
        with self._lock:
            self.policy_version = version
            for e in self._engines.values():
                if e.state is EngineState.SERVING and not self._in_bound(e.version):
                    e.state = EngineState.STALE

    def assume_version(self, urls: Sequence[str], version: int) -> None:
        """Another process (trainer rank 0) saw ``urls`` confirm ``version``: route to them
        without waiting for this client's next health probe."""
        self.set_policy_version(version)
        with self._lock:
            for u in urls:
                e = self._engines.get(u)
                if e is not None and e.state in (
                    EngineState.SERVING, EngineState.STALE, EngineState.LOADING
                ):  # fmt: skip
                    e.version = version
                    e.verified = (e.pid, version)  # the client that confirmed it checked it
                    e.state = EngineState.SERVING
            self._lock.notify_all()

    def urls_at(self, version: int) -> list[str]:
        """Engines last seen serving ``version``."""
        with self._lock:
            return [
                u
                for u, e in self._engines.items()
                if e.version == version and e.state is not EngineState.DEAD
            ]

    def sync_weights(
        self, version: int, path: str | None = None, *, rewrite: Callable[[], Any] | None = None
    ) -> SyncResult:
        """Make ``version`` the trainer's version and push it to every live engine in
        parallel. Returns after every engine confirmed or the timeout passed; an engine
        that did not confirm stays out of routing until it reports the version.

        With ``fingerprints``, each confirmation is checked; an engine whose refit failed
        (its update answered an error, or its answers did not match) is quarantined and
        refit again; ``rewrite`` (the trainer publishing ``version`` again) is called once
        first when an engine found the file not to be what was written."""
        self.set_policy_version(version)
        timeout = self.sync_timeout_s()
        with self._lock:
            targets = [
                e
                for e in self._engines.values()
                if e.state not in (EngineState.DEAD, EngineState.LOADING, EngineState.UNKNOWN)
            ]
        body: dict[str, Any] = {"version": version}
        if path is not None:
            body["path"] = path
        t0 = time.perf_counter()
        futs = {
            self._pool.submit(self._http, e, "POST", "/v1/weights/update", body, timeout): e
            for e in targets
        }
        done, _ = wait(list(futs), timeout=timeout)
        confirmed, missed = [], []
        failed: dict[str, str] = {}
        with self._lock:
            for fut, eng in futs.items():
                ok = False
                if fut in done:
                    try:
                        ok = fut.result().get("version") == version
                    except _Failure as f:
                        if f.reason == "http_5xx":  # the engine tried and failed to load it
                            failed[eng.url] = str(f)
                    except AttributeError:
                        ok = False
                if ok:
                    eng.version = version
                    if self._fingerprints is not None:  # routed once checked (below)
                        eng.state = EngineState.LOADING
                    elif eng.state is EngineState.STALE:
                        eng.state = EngineState.SERVING
                    confirmed.append(eng.url)
                else:
                    if eng.state is EngineState.SERVING:
                        eng.state = EngineState.STALE
                    missed.append(eng.url)
            self._lock.notify_all()
        if self._fingerprints is not None:
            confirmed, missed = self._verify_refits(
                version, body, confirmed, missed, timeout, failed, rewrite
            )
        dt = time.perf_counter() - t0
        if confirmed and not missed:
            self._sync_times.append(dt)
        if missed:
            logger.warning(
                "weight version %d: %s did not confirm in %.1f s; they refit later",
                version,
                missed,
                timeout,
            )
        return SyncResult(version, dt, timeout, confirmed, missed)

    # -- refit checks ------------------------------------------------------------------------
    def _needs_check(self, eng: _Engine) -> bool:
        return (
            self._fingerprints is not None
            and eng.verified != (eng.pid, eng.version)
            and self._in_bound(eng.version)
        )

    def _check_refit(self, eng: _Engine, version: int) -> str | None:
        """Check that ``eng`` holds ``version`` (its answers against the trainer's
        fingerprint): verified → routable; otherwise quarantined (the engine told, an event
        naming it, the version and what differed). None when verified, else what differed."""
        assert self._fingerprints is not None
        with self._lock:
            if eng.checking:
                return "another check of it is under way"
            eng.checking = True
        try:
            return self._check_refit_once(eng, version)
        finally:
            with self._lock:
                eng.checking = False

    def _check_refit_once(self, eng: _Engine, version: int) -> str | None:
        assert self._fingerprints is not None
        why: str | None
        try:
            fp = self._fingerprints(version)
        except (OSError, ValueError) as e:
            fp, why = None, f"no fingerprint of version {version}: {e}"
        else:
            why = None
        worst = float("nan")
        if fp is None and why is None:  # written without one: the engine's digest check only
            with self._lock:
                eng.verified = (eng.pid, version)
                if eng.state is EngineState.LOADING and eng.version == version:
                    eng.state = (
                        EngineState.SERVING if self._in_bound(version) else EngineState.STALE
                    )
                self._lock.notify_all()
            return None
        if fp is not None:
            try:
                answer = self._http(
                    eng, "POST", "/v1/completions", fingerprint_request(fp),
                    self.config.request_timeout_s,
                )  # fmt: skip
                why, worst = compare(fp, answer, version)
            except _Failure as f:
                return f"the check request failed ({f})"  # not a verdict: checked again later
        if why is not None:
            self._quarantine(eng, version, why)
            return why
        try:
            self._http(eng, "POST", "/v1/weights/verified", {"version": version}, 5.0)
        except _Failure as f:
            return f"the engine did not take the verdict ({f})"
        with self._lock:
            eng.verified = (eng.pid, version)
            eng.version = version
            eng.state = EngineState.SERVING if self._in_bound(version) else EngineState.STALE
            self.refits_verified[eng.url] += 1
            self._lock.notify_all()
        self._emit(ROLLOUT_REFIT_VERIFIED, engine=eng.url, version=version,
                   max_logprob_diff=worst, verified=self.refits_verified[eng.url])  # fmt: skip
        return None

    def _verify_refits(
        self,
        version: int,
        body: dict[str, Any],
        confirmed: list[str],
        missed: list[str],
        timeout: float,
        failed: dict[str, str],
        rewrite: Callable[[], Any] | None,
    ) -> tuple[list[str], list[str]]:
        """Check every engine that confirmed ``version``; quarantine those whose update
        failed; refit again (up to ``refit_attempts`` in all) the quarantined ones: only
        checked engines are routed."""
        ok, todo = [], list(confirmed)
        for url, why in failed.items():
            self._quarantine(self._engines[url], version, f"the refit failed: {why}")
        redo = list(failed)
        for attempt in range(self.config.refit_attempts):
            engines = [self._engines[u] for u in todo]
            verdicts = list(self._pool.map(lambda e: self._check_refit(e, version), engines))
            ok += [e.url for e, why in zip(engines, verdicts, strict=True) if why is None]
            redo += [e.url for e, why in zip(engines, verdicts, strict=True) if why is not None]
            if not redo or attempt + 1 == self.config.refit_attempts:
                break
            if rewrite is not None and any("not what the trainer wrote" in failed.get(u, "")
                                           for u in redo):  # fmt: skip
                rewrite()  # the file was changed after it was written: write it again
                rewrite = None
            again = list(self._pool.map(  # refit again: the update, then the check
                lambda u: self._refit(self._engines[u], body, version, timeout), redo
            ))  # fmt: skip
            failed = {u: why for u, why in zip(redo, again, strict=True) if why is not None}
            for url, why in failed.items():
                self._quarantine(self._engines[url], version, f"the refit failed again: {why}")
            todo, redo = [u for u in redo if u not in failed], list(failed)
        return ok, [u for u in [*missed, *confirmed, *failed] if u not in ok]

    def _refit(
        self, eng: _Engine, body: dict[str, Any], version: int, timeout: float
    ) -> str | None:
        """Ask ``eng`` to load ``version`` again; None when it confirmed, else why not."""
        try:
            got = self._http(eng, "POST", "/v1/weights/update", body, timeout)
        except _Failure as f:
            return str(f)
        if not isinstance(got, dict) or got.get("version") != version:
            return f"it confirmed {got!r:.100}"
        return None

    def _quarantine(self, eng: _Engine, version: int, why: str) -> None:
        with self._lock:
            eng.verified = None
            if eng.state is not EngineState.DEAD:
                eng.state = EngineState.QUARANTINED
            self.refits_quarantined[eng.url] += 1
            self._lock.notify_all()
        try:
            self._http(eng, "POST", "/v1/weights/quarantine", {"version": version,
                       "reason": why[:500]}, 5.0)  # fmt: skip
        except _Failure:
            pass  # out of this client's routing anyway; its own health says the rest
        logger.warning("rollout engine %s quarantined at version %d: %s", eng.url, version, why)
        self._emit(ROLLOUT_ENGINE_QUARANTINED, engine=eng.url, version=version, reason=why,
                   quarantined=self.refits_quarantined[eng.url])  # fmt: skip

    # -- metrics -----------------------------------------------------------------------------
    def take_metrics(self) -> dict[str, float]:
        """The rollout figures since the last call, named for ``tg.log``."""
        with self._lock:
            lat = sorted(self._m_latencies)
            out: dict[str, float] = {
                "rollout_requests": len(lat),
                "rollout_retries": self._m_retries,
                "rollout_failed": sum(self._m_failures.values()),
                "engines_serving": sum(
                    self._routable(e, time.monotonic()) for e in self._engines.values()
                ),
                "engines_total": len(self._engines),
            }
            if lat:
                out["rollout_latency_p50_s"] = lat[len(lat) // 2]
                out["rollout_latency_p99_s"] = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
            if self._m_gen_s > 0:
                out["rollout_tokens_per_s"] = self._m_tokens / self._m_gen_s
            for reason, k in self._m_failures.items():
                out[f"rollout_failed_{reason}"] = k
            self._m_latencies, self._m_failures, self._m_retries = [], Counter(), 0
            self._m_tokens, self._m_gen_s = 0, 0.0
            return out
