"""The engine contract, checked against every engine implementation trainguard starts
(tests/engine_impls.py: the embedded engine, the tests' stub engine, adapters): health
statuses and the replica's identity, readiness only when serving, completions with token ids,
log-probs, the generating weight version and per-request seeds, weight update by version, the
error schema and the request caps. Every answer is read with the contract's own parsers. One
engine process per implementation for the whole module."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine_impls import IMPLS, EngineImpl, RunningEngine
from trainguard.core import jsonhttp
from trainguard.core.contracts import engine as ec
from trainguard.core.fleetauth import sign
from trainguard.rl import RolloutClient, RolloutConfig
from trainguard.rl.weights import WeightStore

pytestmark = pytest.mark.xdist_group("engine_conformance")

S = ec.ReplicaStatus


class Subject:
    """One running implementation and what it answered before any version was published."""

    def __init__(self, impl: EngineImpl, root: Path) -> None:
        self.impl = impl
        self.store = WeightStore(root / "weights")
        self.engine = RunningEngine(impl, self.store.root, root / f"{impl.name}.log")
        self.early = self.engine.wait_health(lambda h: h.status is not S.STARTING, impl.startup_s)
        self.early_completion = self.post(ec.COMPLETIONS_PATH, {"prompt": "write"})
        self.state = impl.state()
        self.store.publish(0, self.state)
        self.engine.wait_health(lambda h: h.status is S.SERVING, impl.startup_s)

    def post(self, path: str, body: Any) -> jsonhttp.Response:
        return jsonhttp.request(
            "127.0.0.1", self.engine.port, "POST", path, body, timeout=30.0, max_bytes=1 << 24,
            token=self.engine.token,
        )  # fmt: skip

    def get(self, path: str) -> jsonhttp.Response:
        return jsonhttp.request(
            "127.0.0.1", self.engine.port, "GET", path, timeout=30.0, max_bytes=1 << 24,
            token=self.engine.token,
        )  # fmt: skip

    def health(self) -> ec.HealthAnswer:
        r = self.get(ec.HEALTH_PATH)
        assert r.status == 200
        return ec.parse_health(r.body)

    def complete(self, **body: Any) -> ec.CompletionAnswer:
        prompts = body.get("prompt", "write")
        r = self.post(ec.COMPLETIONS_PATH, {"prompt": prompts, **body})
        assert r.status == 200, r.body[:300]
        want = (len(prompts) if isinstance(prompts, list) else 1) * body.get("n", 1)
        return ec.parse_completion(r.body, expected=want, vocab_size=self.health().vocab_size)


@pytest.fixture(scope="module", params=[pytest.param(i, marks=i.marks, id=i.name) for i in IMPLS])
def subject(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Subject]:
    impl: EngineImpl = request.param
    root = tmp_path_factory.mktemp(f"conformance-{impl.name}")
    s = None
    try:
        s = Subject(impl, root)
        yield s
    finally:
        if s is not None:
            s.engine.close()


def error_of(r: jsonhttp.Response) -> dict[str, Any]:
    body = json.loads(r.body)
    assert set(body) == {"error"} and isinstance(body["error"]["message"], str), body
    assert body["error"]["code"] == r.status
    return dict(body["error"])


def test_health_reports_a_contract_status_and_the_replicas_identity(subject: Subject) -> None:
    h = subject.health()
    assert h.status is S.SERVING and h.weight_version == 0 and h.inflight == 0
    assert h.pid == subject.engine.proc.pid
    assert h.incarnation == subject.engine.incarnation  # the nonce it was started with
    if subject.impl.vocab_size is not None:
        assert h.vocab_size == subject.impl.vocab_size


def test_not_ready_and_no_completion_before_a_version_is_loaded(subject: Subject) -> None:
    assert subject.early.status in (S.LOADING, S.STARTING) and subject.early.weight_version is None
    r = subject.early_completion
    assert r.status == 503
    assert "not serving" in error_of(r)["message"]


def test_completions_carry_token_ids_logprobs_and_the_weight_version(subject: Subject) -> None:
    prompts = ["please write 3 now", "write 5"]
    a = subject.complete(prompt=prompts, n=2, max_tokens=4, logprobs=0, temperature=1.0)
    assert a.weight_version == 0
    assert a.incarnation in (None, subject.engine.incarnation)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    for c in a.choices:
        assert 1 <= len(c.token_ids) <= 4 and c.finish_reason in ("length", "stop")
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.logprobs)
    plain = subject.complete(prompt="write", max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_a_seeded_request_repeats_exactly(subject: Subject) -> None:
    ask = {"prompt": ["please write 7 now"], "n": 2, "max_tokens": 6, "temperature": 1.0}
    first = subject.complete(**ask, seed=1234)
    again = subject.complete(**ask, seed=1234)
    other = subject.complete(**ask, seed=99)
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in again.choices]
    assert [c.token_ids for c in first.choices] != [c.token_ids for c in other.choices]


def test_weight_update_by_version(subject: Subject) -> None:
    missing = subject.post(ec.WEIGHT_UPDATE_PATH, {"version": 99})
    assert missing.status == 404 and "99" in error_of(missing)["message"]
    bad = subject.post(ec.WEIGHT_UPDATE_PATH, {"version": "one"})
    assert bad.status == 400 and error_of(bad)
    subject.store.publish(1, subject.state)
    r = subject.post(ec.WEIGHT_UPDATE_PATH, {"version": 1})
    assert r.status == 200 and ec.parse_weight_update(r.body).version == 1
    assert subject.health().weight_version == 1
    assert ec.parse_weights(subject.get(ec.WEIGHTS_PATH).body) == 1
    assert subject.complete(max_tokens=2).weight_version == 1


def test_every_request_needs_the_jobs_signature(subject: Subject) -> None:
    """Without the job's signature (or signed with another token) every request is 401 with
    one line, health included, and the body unread; a signed answer is signed back; a weight
    update names a version of the store, never a file."""
    port = subject.engine.port
    for token in (None, "0" * 64):
        for method, path, body in (
            ("GET", ec.HEALTH_PATH, None),
            ("POST", ec.COMPLETIONS_PATH, {"prompt": "write"}),
            ("POST", ec.WEIGHT_UPDATE_PATH, {"version": 0}),
        ):
            r = jsonhttp.request(
                "127.0.0.1", port, method, path, body, timeout=30.0, max_bytes=1 << 20, token=token
            )
            assert r.status == 401 and "\n" not in error_of(r)["message"], (token, path)
            assert "weight_version" not in r.body.decode() and b"serving" not in r.body
    file = str(subject.store.path_of(0))
    r = subject.post(ec.WEIGHT_UPDATE_PATH, {"version": 0, "path": file})
    assert r.status == 400 and "unknown fields ['path']" in error_of(r)["message"]


def test_a_failed_refit_check_quarantines_until_a_version_is_verified(subject: Subject) -> None:
    """A client's refit check (``trainguard.rl.verify``): the prompt log-probs of fixed texts
    (one per prompt token, the first None); a quarantined engine answers nothing but such a
    check until a client verified the version it holds."""
    v = subject.health().weight_version
    assert v is not None
    texts = ["please write 3 7 now", "write digits 1 2 now"]
    check = {"prompt": texts, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
             "refit_check": True}  # fmt: skip
    r = subject.post(ec.COMPLETIONS_PATH, check)
    assert r.status == 200, r.body[:300]
    got = ec.parse_prompt_logprobs(r.body, expected=len(texts))
    assert got.weight_version == v
    for ids, lps in got.prompts:
        assert len(lps) >= 2 and lps[0] is None and all(x is not None for x in lps[1:])
        assert ids is None or len(ids) == len(lps)
    assert subject.post(ec.QUARANTINE_PATH, {"version": v, "reason": "a test"}).status == 200
    assert subject.health().status is S.QUARANTINED
    refused = subject.post(ec.COMPLETIONS_PATH, {"prompt": "write", "max_tokens": 2})
    assert refused.status == 503 and "quarantined" in error_of(refused)["message"]
    assert subject.post(ec.COMPLETIONS_PATH, check).status == 200
    other = subject.post(ec.VERIFIED_PATH, {"version": v + 1000})
    assert other.status == 409 and str(v) in error_of(other)["message"]
    assert subject.health().status is S.QUARANTINED
    assert subject.post(ec.VERIFIED_PATH, {"version": v}).status == 200
    assert subject.health().status is S.SERVING
    assert subject.complete(max_tokens=2).weight_version == v


def test_errors_answer_in_one_schema(subject: Subject) -> None:
    assert error_of(subject.post(ec.COMPLETIONS_PATH, {"prompt": 5}))["code"] == 400
    assert error_of(subject.post(ec.COMPLETIONS_PATH, ["not", "an", "object"]))["code"] == 400
    assert error_of(subject.get("/no/such/path"))["code"] == 404


def test_request_bodies_and_depth_are_capped(subject: Subject) -> None:
    port = subject.engine.port
    auth = "".join(
        f"{k}: {v}\r\n"
        for k, v in sign(subject.engine.token, "POST", "/v1/completions", port).items()
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 268435456\r\n\r\n".encode()
        )
        head = b""
        while chunk := s.recv(65536):  # the server answers and closes, the body unread
            head += chunk
    assert head.startswith(b"HTTP/1.1 413") and b"larger than this server's limit" in head
    deep = json.loads("[" * 50 + "]" * 50)
    r = subject.post(ec.COMPLETIONS_PATH, {"prompt": "write", "extra": deep})
    assert r.status == 400 and "nested" in error_of(r)["message"]
    assert subject.health().status is S.SERVING  # and it goes on serving


def test_the_rollout_client_generates_from_it(subject: Subject) -> None:
    version = subject.health().weight_version
    assert version is not None
    expected = {subject.engine.url: ec.Identity(None, subject.engine.incarnation)}
    cfg = RolloutConfig(health_interval_s=0.2, prompts_per_request=2)
    with RolloutClient(
        [subject.engine.url], config=cfg, identities=lambda: expected, token=subject.engine.token
    ) as client:
        client.set_policy_version(version)
        client.wait_serving(1, timeout=30)
        out = client.generate(["write", "please write 1 now", "now"], n=2, max_tokens=3, seed=5)
        assert [len(g) for g in out] == [2, 2, 2]
        assert all(
            c.weight_version == version and c.engine == subject.engine.url for g in out for c in g
        )
        assert sum(client.failures.values()) == 0
