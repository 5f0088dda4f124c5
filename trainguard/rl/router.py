"""The fleet endpoint: one OpenAI-compatible URL for environments, in front of the rollout
engines.

    python -m trainguard.rl.router --port P [--host 127.0.0.1]

The roles plugin starts it beside the trainer (``[roles] router = true``) and gives its URL
to the trainer's workers and the role replicas (``TRAINGUARD_FLEET_URL``). It serves

- ``POST /v1/completions``: the request (OpenAI's fields, as the engines take them) sent to
  the least-loaded serving engine of the rollout client's own engine table
  (:class:`trainguard.rl.routing.EngineTable`: the same health probes, identity checks and
  routing as the trainer's client); an answer that fails (refused, timed out, HTTP 5xx, 401,
  or malformed: checked by the engine contract's one parser) is retried on another engine, at
  most ``max_attempts`` times and within ``request_timeout_s`` of waiting for a serving
  engine; then 503 with the reasons. An engine's 4xx (the request's own fault) is passed on.
  The engine's answer is returned as it came.
- ``GET /v1/models``: the models the serving engines report; ``GET /health``: ``serving``
  while at least one engine is routable (else ``loading``), with the count.

It follows the placement the role supervisors publish in the run directory
(``roles/rollout/<i>.json``, re-read every ``health_interval_s``): a replica restarted,
promoted from a standby or re-placed on another node is routed to at its current URL once its
health says ``serving``. Every request to it is checked with the job's ``fleet`` token (as an
engine checks the ``rollout`` token: :mod:`trainguard.core.fleetauth`); it signs its own
requests to the engines with the ``rollout`` token, which its callers never hold.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from trainguard.core.contracts import envvars
from trainguard.core.contracts.engine import (
    COMPLETIONS_PATH,
    HEALTH_PATH,
    MALFORMED,
    MODELS_PATH,
    Identity,
    MalformedAnswer,
    parse_completion,
)
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.fleetauth import Authenticator
from trainguard.core.jsonhttp import HTTPError, JSONHandler, JSONServer
from trainguard.rl.placement import published_placement
from trainguard.rl.rollout_types import RolloutConfig, urls_from_env
from trainguard.rl.routing import EngineRecord, EngineTable, RequestFailure

__all__ = ["FleetRouter", "RouterHandler", "main", "serve"]

logger = logging.getLogger(__name__)


class FleetRouter:
    """The routing of the fleet endpoint (see the module docstring): ``urls`` (replica ``i``
    first, as ``TRAINGUARD_ROLLOUT_URLS``) until the run directory's published placement
    says otherwise."""

    def __init__(
        self,
        urls: Sequence[str],
        config: RolloutConfig,
        *,
        run_dir: str | None = None,
        engine_token: str | None = None,
        node: str = "",
    ) -> None:
        """``node``: this node's name in the job; a replica published on loopback by another
        node's supervisor (beside another trainer node) is that node's, never followed here."""
        self.config = config
        self.node = node
        self.base = [u.rstrip("/") for u in urls]
        self.run_dir = run_dir
        self.table = EngineTable(
            self.placement(),
            config,
            identities=self._identities if run_dir else None,
            token=engine_token,
        )
        self.counts: Counter[str] = Counter()
        """``requests``, ``answered``, ``retries``, ``failed`` (503 to the caller) and the
        failures by reason."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- placement ---------------------------------------------------------------------------
    def _published(self) -> list[dict[str, Any]]:
        if not self.run_dir:
            return []
        try:
            return RunDir(self.run_dir).role_states().get("rollout", [])
        except OSError:
            return []

    def placement(self) -> list[str]:
        """The engines' URLs as published (:func:`trainguard.rl.placement.published_placement`)."""
        return published_placement(self.base, self._published(), self.node)

    def _identities(self) -> Mapping[str, Identity]:
        out = {}
        for rep in self._published():
            url, inc = rep.get("url"), rep.get("incarnation")
            if isinstance(url, str) and isinstance(inc, str):
                out[url.rstrip("/")] = Identity(None, inc)  # the nonce: a wrapper changes the pid
        return out

    def refresh(self) -> None:
        try:
            self.table.set_urls(self.placement())
        except ValueError as e:  # a bad URL published: the last good placement stays
            logger.warning("fleet endpoint: placement not followed: %s", e)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.table.start()
        self._thread = threading.Thread(target=self._loop, name="fleet-placement", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.config.health_interval_s):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        self.table.close()

    # -- requests ----------------------------------------------------------------------------
    def _pick(self, tried: set[str], deadline: float) -> EngineRecord | None:
        with self.table.lock:
            while True:
                eng = self.table.pick(tried)
                if eng is not None:
                    eng.inflight += 1
                    return eng
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.table.lock.wait(min(left, 0.1))

    def complete(self, body: dict[str, Any]) -> bytes:
        """The answer of a serving engine to ``body`` (a ``/v1/completions`` request);
        :class:`HTTPError` 400 for a request an engine refused as invalid, 503 when no
        engine answered within the bound."""
        prompt, n = body.get("prompt"), body.get("n", 1)
        if isinstance(prompt, str):
            count = 1
        elif isinstance(prompt, list) and prompt:
            count = len(prompt)
        else:
            raise HTTPError(400, "'prompt' must be a string or a non-empty list of strings")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1024:
            raise HTTPError(400, "'n' must be an integer in 1..1024")
        cfg = self.config
        self.counts["requests"] += 1
        deadline = time.monotonic() + cfg.request_timeout_s
        tried: set[str] = set()
        reasons: list[str] = []
        for attempt in range(cfg.max_attempts):
            eng = self._pick(tried, deadline)
            if eng is None:
                reasons.append(f"no serving engine within {cfg.request_timeout_s:g} s")
                break
            if attempt:
                self.counts["retries"] += 1
            tried.add(eng.url)
            try:
                raw = self.table.call(eng, "POST", COMPLETIONS_PATH, body, cfg.request_timeout_s)
                parse_completion(raw, expected=count * n, vocab_size=self.table.vocab_size(eng))
            except RequestFailure as f:
                if f.reason == "http_4xx":
                    raise HTTPError(400, f.detail) from None
                self._failed(eng, f.reason, f.detail, reasons)
                continue
            except MalformedAnswer as e:
                self._failed(eng, MALFORMED, str(e), reasons)
                continue
            except Exception as e:  # never a crash of the endpoint: a counted, retried failure
                self._failed(eng, MALFORMED, f"{type(e).__name__}: {e}", reasons)
                continue
            finally:
                with self.table.lock:
                    eng.inflight -= 1
            with self.table.lock:
                eng.request_failures = 0
            self.counts["answered"] += 1
            return raw
        self.counts["failed"] += 1
        raise HTTPError(503, "no engine answered: " + "; ".join(reasons)[:800])

    def _failed(self, eng: EngineRecord, reason: str, detail: str, reasons: list[str]) -> None:
        self.counts[reason] += 1
        reasons.append(f"{eng.url}: {reason}")
        with self.table.lock:
            self.table.note_failure(eng, reason)
        logger.warning("fleet endpoint: %s failed (%s): %s; retried", eng.url, reason, detail)

    def health(self) -> dict[str, Any]:
        n = self.table.num_serving()
        return {
            "status": "serving" if n else "loading",
            "serving_engines": n,
            "engines": len(self.table.engines),
            "pid": os.getpid(),
        }

    def models(self) -> dict[str, Any]:
        now = time.monotonic()
        with self.table.lock:
            names = sorted(
                {
                    e.model or "trainguard-rollout"
                    for e in self.table.engines.values()
                    if self.table.routable(e, now)
                }
            )
        data = [{"id": m, "object": "model", "owned_by": "trainguard"} for m in names]
        return {"object": "list", "data": data}


class RouterHandler(JSONHandler):
    server_version = "trainguard-fleet"
    max_body_bytes = 8 << 20
    router: FleetRouter  # set on the subclass made by serve()
    get_routes = {HEALTH_PATH: "_health", MODELS_PATH: "_models", "/stats": "_stats"}
    post_routes = {COMPLETIONS_PATH: "_completions"}

    def _health(self) -> None:
        self.send_json(200, self.router.health())

    def _models(self) -> None:
        self.send_json(200, self.router.models())

    def _stats(self) -> None:
        self.send_json(200, dict(self.router.counts))

    def _completions(self) -> None:
        body = self.read_object()
        self.send_json(200, None, raw=self.router.complete(body))


def serve(
    router: FleetRouter, host: str, port: int, token: str | None, max_connections: int = 256
) -> JSONServer:
    """The endpoint's server (not yet serving: call ``serve_forever``); every request checked
    against the ``fleet`` ``token`` (None: no check)."""
    auth = Authenticator("fleet", token) if token else None
    handler = type("FleetHandler", (RouterHandler,), {"router": router, "authenticator": auth})
    return JSONServer((host, port), handler, max_connections=max_connections)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard.rl.router", description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--urls", default=None, help=f"default: ${envvars.ROLLOUT_URLS}")
    p.add_argument("--health-interval-s", type=float, default=0.5)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--max-attempts", type=int, default=4)
    p.add_argument("--node", default="", help="this node's name in the job (its agent's)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fleet endpoint: %(message)s")
    urls = [u for u in (a.urls or "").split(",") if u.strip()] if a.urls else urls_from_env()
    run_dir = envvars.run_dir(os.environ)
    if not urls and not run_dir:
        print(f"fleet endpoint: no engines: set {envvars.ROLLOUT_URLS} or --urls", file=sys.stderr)
        return 2
    token = os.environ.get(envvars.FLEET_TOKEN) or None
    try:
        config = RolloutConfig(
            health_interval_s=a.health_interval_s,
            health_timeout_s=min(2.0, a.request_timeout_s),
            request_timeout_s=a.request_timeout_s,
            max_attempts=a.max_attempts,
            failure_cooldown_s=0.5,
            failure_cooldown_max_s=4.0,
        )
        router = FleetRouter(
            urls,
            config,
            run_dir=run_dir,
            engine_token=os.environ.get(envvars.ROLLOUT_TOKEN) or None,
            node=a.node,
        )
    except ValueError as e:
        print(f"fleet endpoint: {e}", file=sys.stderr)
        return 2
    try:
        server = serve(router, a.host, a.port, token)
    except OSError as e:
        print(f"fleet endpoint: cannot bind {a.host}:{a.port}: {e.strerror}", file=sys.stderr)
        return 2
    router.start()
    port = server.server_address[1]
    print(json.dumps({"fleet_endpoint": f"http://{a.host}:{port}", "pid": os.getpid()}), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        router.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
