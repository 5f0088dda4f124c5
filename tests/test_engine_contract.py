"""The engine contract's code (trainguard.core.contracts.engine, trainguard.core.jsonhttp): one
vocabulary for a replica's states, guarded parsers that turn any hostile answer into a
``MalformedAnswer``, and the shared JSON server's caps (413, 503, socket timeouts, answer size)
on a real server on loopback. The contract against each engine implementation is
tests/test_engine_conformance.py."""

from __future__ import annotations

import ast
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainguard.core import jsonhttp
from trainguard.core.contracts import engine as ec
from trainguard.core.contracts.metrics import ROLE_STATES, ROLLOUT_FAILURE_REASONS

REPO = Path(__file__).resolve().parents[1]
VOCAB = {s.value for s in ec.ReplicaStatus}


# -- one vocabulary ----------------------------------------------------------------------------
def _second_spellings(root: Path) -> list[str]:
    """Places outside the contract module that spell a replica state as a string literal:
    compared with, assigned to or passed as a ``state``/``status``, a ``"status"``/``"state"``
    key's value, or an Enum with two or more of the vocabulary's values."""

    def is_vocab(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in VOCAB

    def about_state(node: ast.AST) -> bool:
        text = ast.unparse(node).lower()
        return "state" in text or "status" in text

    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "core/contracts/engine.py":
            continue
        where = path.relative_to(root.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            hits: list[ast.AST] = []
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                for side in sides:
                    items = (
                        side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    )
                    if any(map(is_vocab, items)) and any(
                        about_state(o) for o in sides if o is not side
                    ):
                        hits.append(node)
            elif isinstance(node, ast.Call) and about_state(node.func):
                hits += [a for a in [*node.args, *(k.value for k in node.keywords)] if is_vocab(a)]
            elif isinstance(node, ast.Assign) and is_vocab(node.value):
                hits += [t for t in node.targets if about_state(t)]
            elif isinstance(node, ast.Dict):
                hits += [
                    v
                    for k, v in zip(node.keys, node.values, strict=True)
                    if isinstance(k, ast.Constant)
                    and k.value in ("state", "status")
                    and is_vocab(v)
                ]
            elif isinstance(node, ast.ClassDef) and any(
                "enum" in ast.unparse(b).lower() for b in node.bases
            ):
                values = [
                    s.value for s in node.body if isinstance(s, ast.Assign) and is_vocab(s.value)
                ]
                if len(values) >= 2:
                    hits.append(node)
            found += [
                f"{where}:{getattr(h, 'lineno', node.lineno)}: {ast.unparse(node)[:80]}"
                for h in hits
            ]
    return found


def test_replica_states_have_one_spelling_in_the_product() -> None:
    assert _second_spellings(REPO / "trainguard") == []


def test_the_vocabulary_test_finds_a_second_spelling(tmp_path: Path) -> None:
    pkg = tmp_path / "trainguard"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "import enum\n"
        "class St(enum.Enum):\n    A = 'serving'\n    B = 'dead'\n"
        "def f(eng, h):\n"
        "    if h.get('status') == 'serving':\n        eng.state = 'suspect'\n"
        "    eng.set_state('loading')\n    return {'state': 'stopped'}\n"
    )
    assert len(_second_spellings(pkg)) == 5


def test_contract_tuples_derive_from_the_enum() -> None:
    assert ROLE_STATES == tuple(s.value for s in ec.REPLICA_STATES)
    assert set(ROLE_STATES) <= VOCAB
    assert ec.MALFORMED in ROLLOUT_FAILURE_REASONS
    assert set(ec.READY_STATUSES) <= set(ec.ENGINE_STATUSES)
    # a str enum: JSON, f-strings and comparisons see the plain value
    assert json.dumps({"s": ec.ReplicaStatus.SERVING}) == '{"s": "serving"}'
    assert f"{ec.ReplicaStatus.DEAD}" == "dead" == ec.ReplicaStatus.DEAD


# -- guarded parsers ---------------------------------------------------------------------------
GOOD_CHOICE = {"index": 0, "text": "a", "token_ids": [1, 2], "finish_reason": "length"}


def completion(**over: Any) -> bytes:
    c = {**GOOD_CHOICE, **over.pop("choice", {})}
    return json.dumps({"choices": [c], "weight_version": 3, **over}).encode()


HOSTILE_COMPLETIONS = {
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "deep_object": b'{"a":' * 50 + b"1" + b"}" * 50,
    "not_json": b'{"choices": [{"ind',
    "nan_logprob": completion(choice={"logprobs": {"token_logprobs": [float("nan"), 0.0]}}),
    "inf_logprob": completion().replace(
        b'"finish_reason"', b'"logprobs": {"token_logprobs": [1e999, -1]}, "finish_reason"'
    ),
    "positive_logprob": completion(choice={"logprobs": {"token_logprobs": [3.0, -1.0]}}),
    "logprob_count": completion(choice={"logprobs": {"token_logprobs": [-1.0]}}),
    "string_index": completion(choice={"index": "0"}),
    "bool_index": completion(choice={"index": True}),
    "float_token": completion(choice={"token_ids": [1.5]}),
    "string_token": completion(choice={"token_ids": ["7"]}),
    "negative_token": completion(choice={"token_ids": [-7]}),
    "huge_token": completion(choice={"token_ids": [10**12]}),
    "token_beyond_vocab": completion(choice={"token_ids": [50]}),
    "400_digits": completion().replace(b'"weight_version": 3', b'"weight_version": ' + b"9" * 400),
    "negative_version": completion(weight_version=-1),
    "no_text": completion(choice={"text": None}),
    "choices_not_list": json.dumps({"choices": {"0": GOOD_CHOICE}, "weight_version": 3}).encode(),
    "not_object": b"[1, 2]",
}


@pytest.mark.parametrize("shape", sorted(HOSTILE_COMPLETIONS))
def test_every_hostile_completion_is_one_malformed_answer(shape: str) -> None:
    with pytest.raises(ec.MalformedAnswer) as err:
        ec.parse_completion(HOSTILE_COMPLETIONS[shape], expected=1, vocab_size=50)
    assert err.value.reason == "malformed" and err.value.detail


def test_a_good_completion_parses_typed_and_in_index_order() -> None:
    raw = json.dumps(
        {
            "choices": [
                {
                    **GOOD_CHOICE,
                    "index": 1,
                    "text": "b",
                    "logprobs": {"token_logprobs": [-1, -0.5]},
                },
                GOOD_CHOICE,
            ],
            "weight_version": 7,
            "incarnation": "x1",
        }
    ).encode()
    a = ec.parse_completion(raw, expected=2, vocab_size=3)
    assert [c.text for c in a.choices] == ["a", "b"] and a.weight_version == 7
    assert a.choices[1].logprobs == [-1.0, -0.5] and a.choices[0].logprobs is None
    assert a.incarnation == "x1"
    with pytest.raises(ec.MalformedAnswer, match="twice"):
        ec.parse_completion(raw.replace(b'"index": 1', b'"index": 0'), expected=2)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"status": "serving", "inflight": -1000000000}', "inflight"),
        (b'{"status": "serving", "weight_version": "3"}', "weight_version"),
        (b'{"status": "exploding"}', "unknown status"),
        (b'{"weight_version": 3}', "status"),
        (b'{"status": "serving", "pid": 0}', "pid"),
        (b'{"status": "serving", "incarnation": 5}', "incarnation"),
        (b"[" * 100_000, "bytes"),
        (b"{" * 1000, "is not JSON"),
    ],
)
def test_hostile_health_answers_are_malformed(raw: bytes, says: str) -> None:
    with pytest.raises(ec.MalformedAnswer, match=says):
        ec.parse_health(raw)


def test_health_carries_identity() -> None:
    h = ec.parse_health(b'{"status": "loading", "pid": 42, "incarnation": "n-1", "inflight": 2}')
    assert h.status is ec.ReplicaStatus.LOADING and h.identity == ec.Identity(42, "n-1")
    assert ec.identity_mismatch(h.identity, None) is None
    assert ec.identity_mismatch(h.identity, ec.Identity(None, "n-1")) is None
    assert "incarnation" in (ec.identity_mismatch(h.identity, ec.Identity(None, "n-2")) or "")
    assert "pid" in (ec.identity_mismatch(h.identity, ec.Identity(41, None)) or "")
    squatter = ec.parse_health(b'{"status": "serving"}').identity
    assert ec.identity_mismatch(squatter, ec.Identity(None, "n-1"))


@pytest.mark.parametrize(
    "raw",
    [b'{"rewards": [NaN]}', b'{"rewards": [1e999]}', b'{"rewards": [-Infinity]}',
     b'{"rewards": [' + b"9" * 400 + b"]}", b'{"rewards": ["1.0"]}', b'{"rewards": [true]}',
     b'{"rewards": [1e12]}', b'{"rewards": [1.0, 2.0]}', b'{"rewards": 1.0}'],
)  # fmt: skip
def test_non_finite_absurd_or_miscounted_rewards_never_parse(raw: bytes) -> None:
    with pytest.raises(ec.MalformedAnswer):
        ec.parse_rewards(raw, expected=1)
    assert ec.parse_rewards(b'{"rewards": [0.5]}', expected=1).rewards == [0.5]


def test_weight_answers_and_error_messages() -> None:
    assert ec.parse_weight_update(b'{"version": 4, "load_s": 0.1}') == ec.WeightUpdateAnswer(4, 0.1)
    assert ec.parse_weights(b'{"version": null}') is None
    with pytest.raises(ec.MalformedAnswer):
        ec.parse_weight_update(b'{"version": 4, "load_s": -1}')
    assert ec.error_message(b'{"error": {"message": "no such version"}}') == "no such version"
    assert ec.error_message(b"[" * 100_000) == "[" * 200  # never raises


def test_a_parser_never_raises_anything_but_malformed() -> None:
    class Weird(dict[str, Any]):
        def get(self, *a: Any) -> Any:
            raise RuntimeError("boom")

    with pytest.raises(ec.MalformedAnswer, match="RuntimeError: boom"):
        ec.parse_health(Weird())


# -- the shared JSON server and client ---------------------------------------------------------
class EchoHandler(jsonhttp.JSONHandler):
    timeout = 1.0
    max_body_bytes = 1000
    get_routes = {"/health": "_health", "/big": "_big"}
    post_routes = {"/echo": "_echo", "/slow": "_slow"}
    allow = True
    release = threading.Event()

    def authorize(self) -> bool:
        return type(self).allow

    def _health(self) -> None:
        self.send_json(200, {"status": "serving"})

    def _big(self) -> None:
        self.send_json(200, {"x": "y" * 5000})

    def _echo(self) -> None:
        self.send_json(200, self.read_json())

    def _slow(self) -> None:
        type(self).release.wait(10)
        self.send_json(200, {})


@pytest.fixture
def server() -> Iterator[jsonhttp.JSONServer]:
    handler = type("H", (EchoHandler,), {"release": threading.Event(), "allow": True})
    srv = jsonhttp.JSONServer(("127.0.0.1", 0), handler, max_connections=2)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    handler.release.set()
    srv.shutdown()
    srv.server_close()


def call(
    srv: jsonhttp.JSONServer, method: str, path: str, body: Any = None, **kw: Any
) -> jsonhttp.Response:
    kw.setdefault("timeout", 5.0)
    kw.setdefault("max_bytes", 1 << 20)
    return jsonhttp.request("127.0.0.1", srv.server_address[1], method, path, body, **kw)


def test_request_bodies_are_capped_with_a_reason(server: jsonhttp.JSONServer) -> None:
    assert json.loads(call(server, "POST", "/echo", {"a": 1}).body) == {"a": 1}
    big = call(server, "POST", "/echo", {"a": "x" * 2000})
    assert big.status == 413 and "limit of 1000 bytes" in ec.error_message(big.body)
    # a Content-Length of 256 MiB is refused before a byte of it is read
    with socket.create_connection(server.server_address, timeout=5) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 268435456\r\n\r\n")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413")
    nested = jsonhttp.request(
        "127.0.0.1", server.server_address[1], "POST", "/echo", json.loads("[" * 20 + "]" * 20),
        timeout=5.0, max_bytes=1 << 20,
    )  # fmt: skip
    assert nested.status == 400 and "nested deeper" in ec.error_message(nested.body)


def test_errors_unknown_paths_and_the_authorize_hook(server: jsonhttp.JSONServer) -> None:
    r = call(server, "GET", "/nope")
    assert r.status == 404 and json.loads(r.body)["error"]["code"] == 404
    server.RequestHandlerClass.allow = False  # type: ignore[attr-defined]
    r = call(server, "GET", "/health")
    assert r.status == 401 and "unauthorized" in ec.error_message(r.body)


def test_connections_are_bounded_and_stalled_clients_dropped(server: jsonhttp.JSONServer) -> None:
    # the idle clients are dropped after the handler's timeout: long enough that a loaded
    # machine does not drop them before the third connection arrives
    server.RequestHandlerClass.timeout = 4.0
    held = [socket.create_connection(server.server_address, timeout=10) for _ in range(2)]
    deadline = time.monotonic() + 3
    while server._slots._value and time.monotonic() < deadline:  # both accepted
        time.sleep(0.01)
    r = call(server, "GET", "/health")  # a third connection: refused with a reason
    assert r.status == 503 and "connections open" in ec.error_message(r.body)
    for s in held:  # the handler's socket timeout drops a client that sends nothing
        assert s.recv(100) == b""
        s.close()
    assert call(server, "GET", "/health").status == 200


def test_the_client_caps_answers_and_names_transport_failures(server: jsonhttp.JSONServer) -> None:
    with pytest.raises(jsonhttp.TransportError) as err:
        call(server, "GET", "/big", max_bytes=1000)
    assert err.value.reason == "too_large"
    with pytest.raises(jsonhttp.TransportError) as err:
        call(server, "POST", "/slow", {}, timeout=0.3)
    assert err.value.reason == "timeout"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(jsonhttp.TransportError) as err:
        jsonhttp.request("127.0.0.1", port, "GET", "/", timeout=1, max_bytes=10)
    assert err.value.reason == "refused"
    assert ec.probe_health(port, timeout=1).outcome == "refused"
    p = ec.probe_health(server.server_address[1], timeout=2)
    assert p.outcome == "ok" and p.status is ec.ReplicaStatus.SERVING
