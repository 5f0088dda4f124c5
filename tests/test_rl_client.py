"""The rollout client's handling of bad engines, in-process: stub engines on loopback that
answer malformed JSON, incomplete answers, a stale weight version, HTTP 4xx, or never become
ready. Each is a counted failure and a retry on another engine, or one clear RolloutError:
never a hang and never a made-up sample. (The real engine's faults, kill -9 and SIGSTOP are
tests/test_rl_fleet.py.)"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from trainguard.core.contracts.metrics import ROLLOUT_FAILURE_REASONS
from trainguard.rl import RolloutClient, RolloutConfig, RolloutError
from trainguard.testing.ports import free_port

VERSION = 3


class Stub:
    """An engine on 127.0.0.1 speaking the engine contract; ``mode`` says how it answers
    ``/v1/completions``: ``good`` (real choices, text ``"<port>:<prompt>:<j>"``), or one bad
    answer."""

    def __init__(self, mode: str = "good", status: str = "serving") -> None:
        self.mode, self.status = mode, status
        self.requests = 0
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, code: int, raw: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                version = VERSION if stub.status == "serving" else None
                body = {"status": stub.status, "weight_version": version, "pid": os.getpid(),
                        "inflight": 0}  # fmt: skip
                self._send(200, json.dumps(body).encode())

            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.requests += 1
                code, raw = stub.answer(req)
                self._send(code, raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def choices(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        prompts = req["prompt"] if isinstance(req["prompt"], list) else [req["prompt"]]
        n = req.get("n", 1)
        return [
            {"index": i * n + j, "text": f"{self.port}:{p}:{j}", "token_ids": [7, i, j],
             "finish_reason": "length"}
            for i, p in enumerate(prompts)
            for j in range(n)
        ]  # fmt: skip

    def answer(self, req: dict[str, Any]) -> tuple[int, bytes]:
        choices = self.choices(req)
        good = {"choices": choices, "weight_version": VERSION}
        bad: dict[str, Any] = {
            "good": good,
            "not_json": b'{"choices": [{"index": 0, "te',
            "not_an_object": [1, 2],
            "no_choices": {"weight_version": VERSION},
            "too_few_choices": {"choices": choices[:-1], "weight_version": VERSION},
            "no_weight_version": {"choices": choices},
            "choice_without_token_ids": {
                "choices": [{k: v for k, v in c.items() if k != "token_ids"} for c in choices],
                "weight_version": VERSION,
            },
            "index_out_of_range": {
                "choices": [{**c, "index": c["index"] + 100} for c in choices],
                "weight_version": VERSION,
            },
            "stale": {"choices": choices, "weight_version": VERSION - 2},
            "http_400": {"error": {"message": "'prompt' must be a string or a list"}},
        }
        out = bad[self.mode]
        code = 400 if self.mode == "http_400" else 200
        return code, out if isinstance(out, bytes) else json.dumps(out).encode()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stubs() -> Iterator[Callable[..., Stub]]:
    made: list[Stub] = []

    def make(mode: str = "good", status: str = "serving") -> Stub:
        made.append(Stub(mode, status))
        return made[-1]

    yield make
    for s in made:
        s.close()


def client_for(
    *stubs: Stub, events: list[dict[str, Any]] | None = None, **cfg: Any
) -> RolloutClient:
    def emit(kind: str, **fields: Any) -> None:
        if events is not None:
            events.append({"kind": kind, **fields})

    settings = {"prompts_per_request": 1, "health_interval_s": 0.2, **cfg}
    client = RolloutClient([s.url for s in stubs], config=RolloutConfig(**settings), events=emit)
    client.set_policy_version(VERSION)
    return client


PROMPTS = [f"prompt {i}" for i in range(6)]


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("not_json", "malformed"),
        ("not_an_object", "malformed"),
        ("no_choices", "malformed"),
        ("too_few_choices", "malformed"),
        ("no_weight_version", "malformed"),
        ("choice_without_token_ids", "malformed"),
        ("index_out_of_range", "malformed"),
        ("stale", "stale"),
    ],
)
def test_a_bad_answer_is_a_counted_failure_retried_on_another_engine(
    stubs: Callable[..., Stub], mode: str, reason: str
) -> None:
    bad, good = stubs(mode), stubs("good")
    events: list[dict[str, Any]] = []
    with client_for(bad, good, events=events, failure_cooldown_s=60.0) as client:
        client.wait_serving(2, timeout=10)
        groups = client.generate(PROMPTS, n=2, max_tokens=4)
        assert bad.requests >= 1  # it did get requests: they failed and moved to the other
        assert client.failures == {reason: bad.requests}
        assert client.retries == bad.requests
        assert [(e["reason"], e["retried"]) for e in events] == [(reason, True)] * bad.requests
        assert {e["kind"] for e in events} == {"rollout_failed"}
        assert {e["engine"] for e in events} == {bad.url}
        # every completion is the good engine's real answer, none made up for the failed ones
        for i, group in enumerate(groups):
            assert [c.text for c in group] == [f"{good.port}:{PROMPTS[i]}:{j}" for j in range(2)]
            assert all(c.engine == good.url and c.weight_version == VERSION for c in group)
            assert all(c.token_ids[:2] == [7, 0] for c in group)
        m = client.take_metrics()
        assert m[f"rollout_failed_{reason}"] == bad.requests == m["rollout_retries"]
        assert m["engines_total"] == 2 and m["rollout_requests"] == len(PROMPTS)
    assert reason in ROLLOUT_FAILURE_REASONS


def test_when_every_engine_answers_badly_the_batch_fails_after_its_cap(
    stubs: Callable[..., Stub],
) -> None:
    a, b = stubs("not_json"), stubs("no_choices")
    events: list[dict[str, Any]] = []
    with client_for(a, b, events=events, failure_cooldown_s=0.0, max_attempts=3) as client:
        client.wait_serving(2, timeout=10)
        with pytest.raises(RolloutError, match="no real generation after 3 attempts") as e:
            client.generate(PROMPTS[:1], n=2)
        assert "\n" not in str(e.value) and "malformed" in str(e.value)
        assert client.failures["malformed"] == 3 == a.requests + b.requests
        assert client.retries == 2  # the third failure ends the batch instead
        assert [e["retried"] for e in events] == [True, True, False]


def test_an_invalid_request_fails_at_once_without_retries(stubs: Callable[..., Stub]) -> None:
    bad = stubs("http_400")
    events: list[dict[str, Any]] = []
    with client_for(bad, events=events, failure_cooldown_s=0.0) as client:
        client.wait_serving(1, timeout=10)
        with pytest.raises(RolloutError, match="refused the request as invalid.*'prompt' must"):
            client.generate(PROMPTS[:1])
        assert client.failures == {"http_4xx": 1} and client.retries == 0 and bad.requests == 1
        assert [(e["reason"], e["retried"]) for e in events] == [("http_4xx", False)]


def test_an_engine_that_never_becomes_ready_gets_no_request(stubs: Callable[..., Stub]) -> None:
    loading = stubs("good", status="loading")
    starting = stubs("good", status="starting")
    with client_for(loading, starting, batch_timeout_s=1.5) as client:
        with pytest.raises(RolloutError, match="0 of 2 engines serving after 1 s"):
            client.wait_serving(1, timeout=1.0)
        with pytest.raises(RolloutError, match="batch of 6 prompts not complete after 2 s"):
            client.generate(PROMPTS)
        assert loading.requests == starting.requests == 0
        assert {e["state"] for e in client.engines().values()} == {"loading"}
        assert sum(client.failures.values()) == 0  # nothing was sent, nothing failed
        loading.status = "serving"  # it loads the weights: it joins
        assert client.wait_serving(1, timeout=10) == 1
        groups = client.generate(PROMPTS)
        assert {c.engine for g in groups for c in g} == {loading.url}
        assert starting.requests == 0


def test_a_url_nobody_listens_on_is_dead_before_the_first_request(
    stubs: Callable[..., Stub],
) -> None:
    good = stubs("good")
    nobody = f"http://127.0.0.1:{free_port()}"
    client = RolloutClient([nobody, good.url], config=RolloutConfig(prompts_per_request=1))
    with client:
        client.set_policy_version(VERSION)
        assert client.engines()[nobody]["state"] == "dead"  # the first probe was refused
        groups = client.generate(PROMPTS)
        assert {c.engine for g in groups for c in g} == {good.url}
        assert sum(client.failures.values()) == 0


@pytest.mark.parametrize(
    ("urls", "says"),
    [
        ([], "no rollout engines"),
        (["127.0.0.1:8100"], "expected http://HOST:PORT"),
        (["http://127.0.0.1"], "expected http://HOST:PORT"),
        (["https://127.0.0.1:8100"], "expected http://HOST:PORT"),
    ],
)
def test_bad_engine_urls_are_one_line(urls: list[str], says: str) -> None:
    with pytest.raises(ValueError, match=says) as e:
        RolloutClient(urls, start=False)
    assert "\n" not in str(e.value)
