"""RolloutClient's retry logic against scripted engines: in-process HTTP servers on loopback
that speak the engine contract and answer what a test tells them (a unit test of the client's
routing, retries and cooldowns; the real engine is tested in test_rl_fleet.py)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from trainguard.rl import RolloutClient, RolloutConfig, RolloutError


class ScriptedEngine:
    """``fail``: how many completion requests to answer with HTTP 500 (``-1``: all of them);
    ``status4xx``: answer every completion request with a 400."""

    def __init__(self) -> None:
        self.fail = 0
        self.status4xx = False
        self.requests: list[float] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200, {"status": "serving", "weight_version": 0, "inflight": 0})

            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.requests.append(time.monotonic())
                if engine.status4xx:
                    self._send(400, {"error": {"message": "bad request"}})
                    return
                if engine.fail != 0:
                    engine.fail -= 1 if engine.fail > 0 else 0
                    self._send(500, {"error": {"message": "scripted failure"}})
                    return
                n = req["n"]
                choices = [
                    {"index": i, "text": "7", "token_ids": [10], "finish_reason": "length"}
                    for i in range(len(req["prompt"]) * n)
                ]
                self._send(200, {"choices": choices, "weight_version": 0})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engines() -> Iterator[list[ScriptedEngine]]:
    es = [ScriptedEngine(), ScriptedEngine()]
    yield es
    for e in es:
        e.close()


def client(engines: list[ScriptedEngine], **cfg: Any) -> RolloutClient:
    c = RolloutClient([e.url for e in engines], config=RolloutConfig(**cfg))
    c.set_policy_version(0)
    c.wait_serving(len(engines), timeout=10)
    return c


def test_cooldown_doubles_per_failure_in_a_row_and_spreads_the_retries(
    engines: list[ScriptedEngine],
) -> None:
    bad, good = engines
    bad.fail, good.fail = 3, -1  # the other engine fails every request, this one three
    with client(engines, failure_cooldown_s=0.2, failure_cooldown_max_s=10, max_attempts=8,
                prompts_per_request=4) as c:  # fmt: skip
        groups = c.generate(["please write 7 now"] * 4, n=2)
        assert [len(g) for g in groups] == [2, 2, 2, 2]
        assert all(comp.engine == bad.url for g in groups for comp in g)
        assert c.failures["http_5xx"] == c.retries >= 3
    gaps = [b - a for a, b in zip(bad.requests, bad.requests[1:], strict=False)]
    assert len(gaps) == 3  # three failed requests to it, then the answer
    # its cooldown after failure k is 0.2 x 2^(k-1): 0.2, 0.4, 0.8 s
    for gap, cooldown in zip(gaps, (0.2, 0.4, 0.8), strict=True):
        assert gap >= cooldown * 0.9, gaps


def test_attempt_cap_and_bad_request_raise_never_fabricate(
    engines: list[ScriptedEngine],
) -> None:
    for e in engines:
        e.fail = -1
    with client(engines, failure_cooldown_s=0.0, max_attempts=3) as c:
        with pytest.raises(RolloutError, match="no real generation after 3 attempts"):
            c.generate(["please write 7 now"], n=2)
    for e in engines:
        e.fail, e.status4xx = 0, True
    with client(engines) as c:
        with pytest.raises(RolloutError, match="refused the request as invalid"):
            c.generate(["please write 7 now"], n=2)
