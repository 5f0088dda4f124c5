"""The rollout client's engine table: the engines it knows, their states from the background
health probes (parsed by the engine contract's one parser, the answering process's identity
checked against what the role supervisor published), and routing (the least-loaded routable
engine)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from trainguard.core import jsonhttp
from trainguard.core.contracts.engine import (
    HEALTH_PATH,
    MALFORMED,
    MAX_ANSWER_BYTES,
    MAX_HEALTH_BYTES,
    Identity,
    MalformedAnswer,
    error_message,
    identity_mismatch,
    parse_health,
)
from trainguard.rl.rollout_types import EngineState, RolloutConfig, RolloutError

__all__ = ["EngineRecord", "EngineTable", "RequestFailure"]

logger = logging.getLogger(__name__)

IdentitySource = Callable[[], Mapping[str, Identity]]
"""URL → the identity of the process the role supervisor started there (its state files)."""


class RequestFailure(Exception):
    """A request without a usable answer; ``reason`` is one of ``FAILURE_REASONS``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)
class EngineRecord:
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
    incarnation: str | None = None
    vocab_size: int | None = None
    model: str | None = None
    verified: tuple[int | None, int] | None = None
    """(pid, version) the refit check last verified (with a ``checker``)."""
    checking: bool = False


def _record(url: str) -> EngineRecord:
    parts = urlsplit(url.rstrip("/"))
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise ValueError(f"rollout engine URL {url!r}: expected http://HOST:PORT")
    return EngineRecord(url.rstrip("/"), parts.hostname, parts.port)


class EngineTable:
    """The engines of one client, their health and the routing among them."""

    def __init__(
        self,
        urls: Sequence[str],
        config: RolloutConfig,
        *,
        identities: IdentitySource | None = None,
        token: str | None = None,
    ) -> None:
        """``token``: the job's ``rollout`` token: every request signed with it, every answer
        checked against it."""
        self.config = config
        self.identities = identities
        self.token = token
        self.auth_error: str | None = None
        """The last refusal of this client's signature by an engine (HTTP 401), one line."""
        self.engines: dict[str, EngineRecord] = {}
        for u in urls:
            rec = _record(u)
            self.engines[rec.url] = rec
        self.lock = threading.Condition()
        self.policy_version: int | None = None
        self._probe_pool = ThreadPoolExecutor(
            max_workers=max(len(self.engines), 16), thread_name_prefix="rollout-health"
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.checker: Callable[[EngineRecord, int], str | None] | None = None
        """The refit check (set by the weight sync with fingerprints): an engine reporting
        a version it was not verified at is checked before it is routed."""

    # -- HTTP --------------------------------------------------------------------------------
    def request_headers(self) -> dict[str, str]:
        """Headers every request to an engine carries (none here)."""
        return {}

    def call(
        self,
        eng: EngineRecord,
        method: str,
        path: str,
        body: object,
        timeout: float,
        max_bytes: int = MAX_ANSWER_BYTES,
    ) -> bytes:
        """The body of a 2xx answer; :class:`RequestFailure` for anything else."""
        try:
            resp = jsonhttp.request(
                eng.host,
                eng.port,
                method,
                path,
                body,
                timeout=timeout,
                max_bytes=max_bytes,
                headers=self.request_headers(),
                token=self.token,
            )
        except jsonhttp.TransportError as e:
            reason = MALFORMED if e.reason == "too_large" else e.reason
            raise RequestFailure(reason, e.detail) from None
        if resp.status == 401:  # retried elsewhere: a process on a dead engine's port says it too
            self.auth_error = f"{eng.url} refused this client's token: {error_message(resp.body)}"
            raise RequestFailure("unauthorized", self.auth_error)
        if resp.status == 503:
            raise RequestFailure("not_serving", error_message(resp.body))
        if resp.status >= 500:
            raise RequestFailure("http_5xx", f"HTTP {resp.status}: {error_message(resp.body)}")
        if resp.status >= 400:
            raise RequestFailure("http_4xx", f"HTTP {resp.status}: {error_message(resp.body)}")
        return resp.body

    # -- health ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self.probe_all()
            self._thread = threading.Thread(target=self._loop, name="rollout-health", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._probe_pool.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.config.health_interval_s):
            try:
                self.probe_all()
            except RuntimeError:  # the pool was shut down: closing
                return

    def probe_all(self) -> None:
        published: Mapping[str, Identity] = {}
        if self.identities is not None:
            try:
                published = self.identities()
            except Exception:  # what the supervisor published is a check, never a crash
                logger.exception("cannot read the role supervisor's replica identities")
        futures = [
            self._probe_pool.submit(self.probe, e, published.get(e.url))
            for e in list(self.engines.values())
        ]
        wait(futures, timeout=self.config.health_timeout_s + 1)

    def probe(self, eng: EngineRecord, expected: Identity | None = None) -> None:
        """One health probe of ``eng``: its state, version and load from the answer."""
        try:
            raw = self.call(
                eng, "GET", HEALTH_PATH, None, self.config.health_timeout_s, MAX_HEALTH_BYTES
            )
            h = parse_health(raw)
            wrong = identity_mismatch(h.identity, expected)
            if wrong is not None:
                raise RequestFailure(
                    MALFORMED, f"not the replica the supervisor started there: {wrong}"
                )
        except MalformedAnswer as e:
            self._probe_failed(eng, RequestFailure(MALFORMED, e.detail))
            return
        except RequestFailure as f:
            self._probe_failed(eng, f)
            return
        with self.lock:
            eng.probe_failures = 0
            eng.reported_inflight = h.inflight
            if eng.incarnation is not None and h.incarnation != eng.incarnation:
                eng.epoch += 1  # a new process behind the same port: old requests are gone
            elif eng.pid is not None and h.pid is not None and h.pid != eng.pid:
                eng.epoch += 1
            eng.pid = h.pid if h.pid is not None else eng.pid
            eng.incarnation = h.incarnation
            eng.vocab_size = h.vocab_size
            eng.model = h.model
            eng.version = h.weight_version
            check = False
            if h.status is EngineState.QUARANTINED:
                eng.state = EngineState.QUARANTINED
            elif h.status is EngineState.SERVING and eng.version is not None:
                check = self.checker is not None and self.unverified(eng)
                if check:
                    eng.state = EngineState.LOADING
                else:
                    ok = self.in_bound(eng.version)
                    eng.state = EngineState.SERVING if ok else EngineState.STALE
            else:
                eng.state = EngineState.LOADING
            self.lock.notify_all()
        if check and self.checker is not None and eng.version is not None:
            self.checker(eng, eng.version)  # a version it loaded by itself: checked first

    def unverified(self, eng: EngineRecord) -> bool:
        """``eng`` reports a version in the bound that no refit check verified (under the
        lock)."""
        return eng.verified != (eng.pid, eng.version) and self.in_bound(eng.version)

    def _probe_failed(self, eng: EngineRecord, f: RequestFailure) -> None:
        with self.lock:
            if f.reason == "refused":
                self.mark_dead(eng, "connection refused")
            else:
                eng.probe_failures += 1
                if eng.probe_failures >= self.config.dead_after_failures:
                    self.mark_dead(eng, f"{eng.probe_failures} failed health probes ({f})")
                elif eng.state is not EngineState.DEAD:
                    eng.state = EngineState.SUSPECT
            self.lock.notify_all()

    def mark_dead(self, eng: EngineRecord, why: str) -> None:
        """(under the lock)"""
        if eng.state is not EngineState.DEAD:
            logger.warning("rollout engine %s is dead: %s", eng.url, why)
        eng.state = EngineState.DEAD
        eng.epoch += 1
        eng.version = None

    def set_urls(self, urls: Sequence[str]) -> bool:
        """Follow a new placement of the engines: those not in ``urls`` leave the table (their
        requests in flight are abandoned and retried elsewhere), new ones join it (routed once
        a probe finds them serving). Whether anything changed; ValueError for a bad URL."""
        records = [_record(u) for u in urls]
        with self.lock:
            want = {r.url: r for r in records}
            gone = [u for u in self.engines if u not in want]
            new = [r for u, r in want.items() if u not in self.engines]
            for u in gone:
                eng = self.engines.pop(u)
                eng.epoch += 1
                eng.state = EngineState.DEAD
                logger.info("rollout engine %s left the placement", u)
            for r in new:
                self.engines[r.url] = r
                logger.info("rollout engine %s joined the placement", r.url)
            if gone or new:
                self.lock.notify_all()
            return bool(gone or new)

    # -- routing -----------------------------------------------------------------------------
    def in_bound(self, version: int | None) -> bool:
        if version is None:
            return False
        pv = self.policy_version
        return pv is None or pv - self.config.max_staleness <= version <= pv

    def routable(self, eng: EngineRecord, now: float) -> bool:
        return (
            eng.state is EngineState.SERVING
            and now >= eng.cooldown_until
            and self.in_bound(eng.version)
        )

    def pick(self, tried: set[str]) -> EngineRecord | None:
        """The least-loaded routable engine, one not ``tried`` yet where there is one
        (under the lock)."""
        now = time.monotonic()
        ok = [e for e in self.engines.values() if self.routable(e, now)]
        if not ok:
            return None
        fresh = [e for e in ok if e.url not in tried] or ok
        return min(fresh, key=lambda e: (e.inflight, e.reported_inflight, e.url))

    def vocab_size(self, eng: EngineRecord) -> int | None:
        """The token-id bound of ``eng``'s answers: the policy's, else the engine's own."""
        return self.config.vocab_size if self.config.vocab_size is not None else eng.vocab_size

    def note_failure(self, eng: EngineRecord, reason: str) -> None:
        """A request to ``eng`` failed: its cooldown and state (under the lock)."""
        cfg = self.config
        eng.request_failures += 1
        cooldown = cfg.failure_cooldown_s * 2 ** min(eng.request_failures - 1, 16)
        eng.cooldown_until = time.monotonic() + min(cooldown, cfg.failure_cooldown_max_s)
        if reason == "refused":
            self.mark_dead(eng, "connection refused")
        elif reason in ("timeout", "connection", "http_5xx", MALFORMED, "not_serving"):
            if eng.state is EngineState.SERVING:
                eng.state = EngineState.SUSPECT
        elif reason == "stale" and eng.state is EngineState.SERVING:
            eng.state = EngineState.STALE

    # -- views and versions ------------------------------------------------------------------
    def summary(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            return {
                u: {"state": e.state.value, "version": e.version, "inflight": e.inflight}
                for u, e in self.engines.items()
            }

    def num_serving(self) -> int:
        now = time.monotonic()
        with self.lock:
            return sum(self.routable(e, now) for e in self.engines.values())

    def wait_serving(self, min_engines: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            n = self.num_serving()
            if n >= min_engines:
                return n
            if time.monotonic() > deadline:
                raise RolloutError(
                    f"{n} of {len(self.engines)} engines serving after {timeout:.0f} s: "
                    f"{self.auth_error or self.summary()}"
                )
            with self.lock:
                self.lock.wait(0.2)

    def set_policy_version(self, version: int) -> None:
        with self.lock:
            self.policy_version = version
            for e in self.engines.values():
                if e.state is EngineState.SERVING and not self.in_bound(e.version):
                    e.state = EngineState.STALE

    def assume_version(self, urls: Sequence[str], version: int) -> None:
        self.set_policy_version(version)
        with self.lock:
            for u in urls:
                e = self.engines.get(u)
                if e is not None and e.state in (
                    EngineState.SERVING, EngineState.STALE, EngineState.LOADING
                ):  # fmt: skip
                    e.version = version
                    e.verified = (e.pid, version)  # the client that confirmed it checked it
                    e.state = EngineState.SERVING
            self.lock.notify_all()

    def urls_at(self, version: int) -> list[str]:
        with self.lock:
            return [
                u
                for u, e in self.engines.items()
                if e.version == version and e.state is not EngineState.DEAD
            ]
