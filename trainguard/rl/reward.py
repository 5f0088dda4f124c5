"""Reward servers: scoring as its own fleet (the ``reward`` role), and the trainer's client.

    python -m trainguard.rl.reward --function MODULE:FUNCTION [--port P]

serves a reward function ``f(prompt: str, completion: str) -> float`` over HTTP on
``127.0.0.1:$TRAINGUARD_AGENT_ROLE_PORT`` (or ``--port``):

``GET /health``
    200 ``{"status": "serving", "function": "MODULE:FUNCTION"}`` once the function is imported.
``POST /v1/rewards``
    ``{"prompts": [str, ...], "completions": [str, ...]}`` (the same length) →
    ``{"rewards": [float, ...]}``, one per pair. 400 with ``{"error": {"message": ...}}`` for bad
    input; 500 when the function raised or returned something that is not a finite number.

:class:`RewardClient` (URLs from ``$TRAINGUARD_REWARD_URLS``, which ``trainguard run`` sets for a
job with a ``reward`` role) sends each request to the next server in turn and retries a failed
one (refused, timeout, HTTP 5xx, a malformed answer) on another, at most ``max_attempts`` times;
then :class:`RewardError`: a reward is never made up. Failures are counted by reason.

Every request, health included, is signed with the job's ``reward`` token (the server's
``$TRAINGUARD_AGENT_ROLE_TOKEN``; the client signs with ``$TRAINGUARD_REWARD_TOKEN`` and checks the
answer's signature); a request without a valid one is answered 401 with one line
(:mod:`trainguard.core.fleetauth`).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import logging
import math
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from trainguard.core import jsonhttp
from trainguard.core.contracts import envvars
from trainguard.core.contracts.engine import (
    HEALTH_PATH,
    MALFORMED,
    MAX_ANSWER_BYTES,
    REWARDS_PATH,
    HealthAnswer,
    MalformedAnswer,
    ReplicaStatus,
    error_message,
    own_identity,
    parse_rewards,
)
from trainguard.core.contracts.event_kinds import REWARD_FAILED
from trainguard.core.fleetauth import Authenticator, replica_token, token_from_env
from trainguard.core.jsonhttp import HTTPError, JSONHandler, JSONServer
from trainguard.rl.client import REWARD_URLS_ENV, urls_from_env

__all__ = ["RewardClient", "RewardError", "load_function", "main"]

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]


class RewardError(RuntimeError):
    """A batch could not be scored by any reward server within the attempt cap."""


def load_function(spec: str) -> RewardFn:
    """``MODULE:FUNCTION`` → the function; ValueError with one line otherwise."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--function {spec!r}: give MODULE:FUNCTION, e.g. mypkg.rewards:score")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--function {spec!r}: cannot import it ({e})") from None
    if not callable(fn):
        raise ValueError(f"--function {spec!r}: not a function")
    return fn


class _RewardHandler(JSONHandler):
    """The reward server's routes on the shared JSON server."""

    server_version = "trainguard-reward"
    max_body_bytes = 8 << 20
    fn: RewardFn  # set on the subclass made by serve()
    spec: str
    get_routes = {HEALTH_PATH: "_health"}
    post_routes = {REWARDS_PATH: "_rewards"}

    def _health(self) -> None:
        me = own_identity()
        body = HealthAnswer(ReplicaStatus.SERVING, pid=me.pid, incarnation=me.incarnation)
        self.send_json(200, {**body.to_json(), "function": self.spec})

    def _rewards(self) -> None:
        body = self.read_object()
        prompts, comps = body.get("prompts"), body.get("completions")
        if (
            not isinstance(prompts, list)
            or not isinstance(comps, list)
            or len(prompts) != len(comps)
            or not all(isinstance(x, str) for x in [*prompts, *comps])
        ):
            raise HTTPError(400, "give 'prompts' and 'completions': lists of strings, same length")
        fn = type(self).fn
        try:
            rewards = [float(fn(p, c)) for p, c in zip(prompts, comps, strict=True)]
        except Exception as e:
            raise HTTPError(500, f"the reward function raised {type(e).__name__}: {e}") from None
        if not all(math.isfinite(r) for r in rewards):
            raise HTTPError(500, "the reward function returned a value that is not finite")
        self.send_json(200, {"rewards": rewards})


def serve(fn: RewardFn, spec: str, host: str, port: int, token: str | None) -> JSONServer:
    """The reward server for ``fn`` on ``host:port`` (not yet serving: call serve_forever);
    every request signed with the ``reward`` role's ``token`` (None: no check)."""
    auth = Authenticator("reward", token) if token else None
    attrs = {"fn": staticmethod(fn), "spec": spec, "authenticator": auth}
    handler = type("Handler", (_RewardHandler,), attrs)
    return JSONServer((host, port), handler)


class RewardClient:
    """See the module docstring. ``urls`` default to ``$TRAINGUARD_REWARD_URLS``."""

    def __init__(
        self,
        urls: Sequence[str] | None = None,
        *,
        timeout_s: float = 30.0,
        max_attempts: int = 6,
        retry_wait_s: float = 0.5,
        events: Callable[..., object] | None = None,
        token: str | None = None,
    ) -> None:
        """``token``: the job's ``reward`` token (default: ``$TRAINGUARD_REWARD_TOKEN``): every
        request is signed with it, every answer must be signed with it."""
        self._token = token or token_from_env("reward")
        urls = list(urls) if urls is not None else urls_from_env(REWARD_URLS_ENV)
        if not urls:
            raise ValueError(
                f"no reward servers: pass urls or set {REWARD_URLS_ENV} "
                "(trainguard run sets it for a job with a reward role)"
            )
        self._hosts: list[tuple[str, str, int]] = []
        for u in urls:
            parts = urlsplit(u.rstrip("/"))
            if parts.scheme != "http" or not parts.hostname or not parts.port:
                raise ValueError(f"reward server URL {u!r}: expected http://HOST:PORT")
            self._hosts.append((u.rstrip("/"), parts.hostname, parts.port))
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.retry_wait_s = retry_wait_s
        self._next = itertools.cycle(range(len(self._hosts)))
        self._lock = threading.Lock()
        self.failures: Counter[str] = Counter()
        self.retries = 0
        self._events = events

    def request_headers(self) -> dict[str, str]:
        """Headers every request to a reward server carries (none here)."""
        return {}

    def _post(self, host: str, port: int, body: object, expected: int) -> list[float]:
        """One request's rewards, parsed by the contract's parser; _Failed otherwise."""
        try:
            resp = jsonhttp.request(
                host, port, "POST", REWARDS_PATH, body,
                timeout=self.timeout_s, max_bytes=MAX_ANSWER_BYTES,
                headers=self.request_headers(), token=self._token,
            )  # fmt: skip
        except jsonhttp.TransportError as e:
            reason = MALFORMED if e.reason == "too_large" else e.reason
            raise _Failed(reason, e.detail) from None
        if resp.status == 401:  # retried: a process on a dead server's port says it too
            raise _Failed("unauthorized", error_message(resp.body))
        if resp.status >= 400:
            raise _Failed(
                "http_4xx" if resp.status < 500 else "http_5xx",
                f"HTTP {resp.status}: {error_message(resp.body)}",
            )
        try:
            return parse_rewards(resp.body, expected=expected).rewards
        except MalformedAnswer as e:
            raise _Failed(MALFORMED, e.detail) from None

    def _emit(self, kind: str, **fields: object) -> None:
        if self._events is not None:
            try:
                self._events(kind, **fields)
            except Exception:  # telemetry never stops the scoring
                logger.exception("could not record a %s event", kind)

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """One reward per (prompt, completion), from a reward server; :class:`RewardError` after
        ``max_attempts`` failed attempts (or at once for a request the server calls invalid)."""
        if len(prompts) != len(completions):
            raise ValueError("score(prompts, completions): give lists of the same length")
        if not prompts:
            return []
        body = {"prompts": list(prompts), "completions": list(completions)}
        reasons: list[str] = []
        refused = ""
        for attempt in range(self.max_attempts):
            with self._lock:
                url, host, port = self._hosts[next(self._next)]
            try:
                return self._post(host, port, body, len(prompts))
            except _Failed as f:
                reason, detail = f.reason, str(f)
                if reason == "unauthorized":
                    refused = f"; {url} refused this client's signature: {f.detail}"
            self.failures[reason] += 1
            reasons.append(f"{url}: {reason}")
            logger.warning("reward request to %s failed (%s): %s", url, reason, detail)
            self._emit(
                REWARD_FAILED,
                reason=reason,
                server=url,
                retried=reason != "http_4xx" and attempt + 1 < self.max_attempts,
                detail=detail[:300],
            )
            if reason == "http_4xx":
                raise RewardError(f"a reward server refused the request as invalid: {detail}")
            if attempt + 1 < self.max_attempts:
                self.retries += 1
                time.sleep(self.retry_wait_s * (attempt // len(self._hosts)))
        raise RewardError(
            f"{len(prompts)} completions: no reward after {self.max_attempts} attempts "
            f"({'; '.join(reasons)}){refused}"
        )


class _Failed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reward[%(process)d] %(message)s")
    p = argparse.ArgumentParser(
        prog="python -m trainguard.rl.reward", description=__doc__.split("\n")[0]
    )
    p.add_argument("--function", required=True, help="MODULE:FUNCTION(prompt, completion)")
    p.add_argument("--port", type=int, default=None, help=f"default: ${envvars.ROLE_PORT}")
    p.add_argument(
        "--host",
        default=os.environ.get(envvars.ROLE_HOST) or "127.0.0.1",
        help=f"default: ${envvars.ROLE_HOST}, else 127.0.0.1",
    )
    a = p.parse_args(argv)
    port = a.port
    if port is None:
        raw = os.environ.get(envvars.ROLE_PORT, "")
        if not raw.isdigit():
            print(f"reward: give --port or set {envvars.ROLE_PORT}", file=sys.stderr)
            return 2
        port = int(raw)
    try:
        fn = load_function(a.function)
    except ValueError as e:
        print(f"reward: {e}", file=sys.stderr)
        return 2
    try:
        token = replica_token("it")
    except ValueError as e:
        print(f"reward: {e}", file=sys.stderr)
        return 2
    try:
        server = serve(fn, a.function, a.host, port, token)
    except OSError as e:
        print(f"reward: cannot bind {a.host}:{port}: {e.strerror}", file=sys.stderr)
        return 2
    logger.info("reward: serving %s on http://%s:%d", a.function, a.host, port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
