"""Reward servers: scoring as its own fleet (the ``reward`` role), and the trainer's client.

    python -m trainguard.rl.reward --function MODULE:FUNCTION [--port P]

serves a reward function ``f(prompt: str, completion: str) -> float`` over HTTP on
``127.0.0.1:$TRAINGUARD_ROLE_PORT`` (or ``--port``):

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
"""

from __future__ import annotations

import argparse
import http.client
import importlib
import itertools
import json
import logging
import math
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from trainguard.core import envvars
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


def _handler(fn: RewardFn, spec: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            pass

        def _send(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str) -> None:
            self._send(code, {"error": {"message": message, "code": code}})

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(
                    200,
                    {
                        "status": "serving",
                        "function": spec,
                        "pid": os.getpid(),
                        "incarnation": os.environ.get(envvars.ROLE_INCARNATION),
                    },
                )
            else:
                self._error(404, f"no such endpoint: GET {self.path}")

        def do_POST(self) -> None:
            if self.path != "/v1/rewards":
                self._error(404, f"no such endpoint: POST {self.path}")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            except ValueError as e:
                self._error(400, f"the request body is not JSON ({e})")
                return
            prompts = body.get("prompts") if isinstance(body, dict) else None
            comps = body.get("completions") if isinstance(body, dict) else None
            if (
                not isinstance(prompts, list)
                or not isinstance(comps, list)
                or len(prompts) != len(comps)
                or not all(isinstance(x, str) for x in [*prompts, *comps])
            ):
                self._error(400, "give 'prompts' and 'completions': lists of strings, same length")
                return
            try:
                rewards = [float(fn(p, c)) for p, c in zip(prompts, comps, strict=True)]
            except Exception as e:
                self._error(500, f"the reward function raised {type(e).__name__}: {e}")
                return
            if not all(math.isfinite(r) for r in rewards):
                self._error(500, "the reward function returned a value that is not finite")
                return
            self._send(200, {"rewards": rewards})

    return Handler


class RewardClient:
    """See the module docstring. ``urls`` default to ``$TRAINGUARD_REWARD_URLS``."""

    def __init__(
        self,
        urls: Sequence[str] | None = None,
        *,
        timeout_s: float = 30.0,
        max_attempts: int = 6,
        retry_wait_s: float = 0.5,
    ) -> None:
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

    def _post(self, host: str, port: int, body: Any) -> Any:
        conn = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
        try:
            conn.request(
                "POST", "/v1/rewards", json.dumps(body), {"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        if resp.status >= 400:
            raise _Failed(
                "http_4xx" if resp.status < 500 else "http_5xx",
                f"HTTP {resp.status}: {raw[:200].decode(errors='replace')}",
            )
        return json.loads(raw)

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """One reward per (prompt, completion), from a reward server; :class:`RewardError` after
        ``max_attempts`` failed attempts (or at once for a request the server calls invalid)."""
        if len(prompts) != len(completions):
            raise ValueError("score(prompts, completions): give lists of the same length")
        if not prompts:
            return []
        body = {"prompts": list(prompts), "completions": list(completions)}
        reasons: list[str] = []
        for attempt in range(self.max_attempts):
            with self._lock:
                url, host, port = self._hosts[next(self._next)]
            try:
                answer = self._post(host, port, body)
                rewards = answer.get("rewards") if isinstance(answer, dict) else None
                if not isinstance(rewards, list) or len(rewards) != len(prompts):
                    raise _Failed("malformed", "the answer has no reward per completion")
                return [float(r) for r in rewards]
            except _Failed as f:
                reason, detail = f.reason, str(f)
            except ConnectionRefusedError as e:
                reason, detail = "refused", str(e)
            except TimeoutError:
                reason, detail = "timeout", f"no answer in {self.timeout_s:g} s"
            except (OSError, http.client.HTTPException, ValueError, TypeError) as e:
                reason, detail = "connection", f"{type(e).__name__}: {e}"
            self.failures[reason] += 1
            reasons.append(f"{url}: {reason}")
            logger.warning("reward request to %s failed (%s): %s", url, reason, detail)
            if reason == "http_4xx":
                raise RewardError(f"a reward server refused the request as invalid: {detail}")
            if attempt + 1 < self.max_attempts:
                self.retries += 1
                time.sleep(self.retry_wait_s * (attempt // len(self._hosts)))
        raise RewardError(
            f"{len(prompts)} completions: no reward after {self.max_attempts} attempts "
            f"({'; '.join(reasons)})"
        )


class _Failed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reward[%(process)d] %(message)s")
    p = argparse.ArgumentParser(
        prog="python -m trainguard.rl.reward", description=__doc__.split("\n")[0]
    )
    p.add_argument("--function", required=True, help="MODULE:FUNCTION(prompt, completion)")
    p.add_argument("--port", type=int, default=None, help="default: $TRAINGUARD_ROLE_PORT")
    p.add_argument(
        "--host",
        default=os.environ.get("TRAINGUARD_ROLE_HOST") or "127.0.0.1",
        help="default: $TRAINGUARD_ROLE_HOST, else 127.0.0.1",
    )
    a = p.parse_args(argv)
    port = a.port
    if port is None:
        raw = os.environ.get("TRAINGUARD_ROLE_PORT", "")
        if not raw.isdigit():
            print("reward: give --port or set TRAINGUARD_ROLE_PORT", file=sys.stderr)
            return 2
        port = int(raw)
    try:
        fn = load_function(a.function)
    except ValueError as e:
        print(f"reward: {e}", file=sys.stderr)
        return 2
    try:
        server = ThreadingHTTPServer((a.host, port), _handler(fn, a.function))
    except OSError as e:
        print(f"reward: cannot bind {a.host}:{port}: {e.strerror}", file=sys.stderr)
        return 2
    server.daemon_threads = True
    logger.info("reward: serving %s on http://%s:%d", a.function, a.host, port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
