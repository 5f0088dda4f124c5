"""A small engine for the tests, as a real process: it speaks the engine contract
(trainguard.core.contracts.engine) on the shared JSON server without a model, or, with
``--hostile``, answers whatever malformed shape a test sets.

    python -m tests.stub_engine --port P --weights-dir D [--hostile]

Well-behaved: ``loading`` until the weight store's pointer names a version, then ``serving``
it; completions of seeded pseudo-random token ids of the tiny policy's vocabulary with
log-probs; ``/v1/weights/update {"version": v}`` loads a version of the store (404 when it is
not there). Hostile: ``POST /control {"shape": S}`` sets how it answers completions, rewards
and health (:data:`SHAPES`); ``GET /control`` says how many requests it got."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import threading
from pathlib import Path
from typing import Any

from trainguard.core.contracts.engine import (
    COMPLETIONS_PATH,
    HEALTH_PATH,
    QUARANTINE_PATH,
    REWARDS_PATH,
    VERIFIED_PATH,
    WEIGHT_UPDATE_PATH,
    WEIGHTS_PATH,
    HealthAnswer,
    own_identity,
    weight_update_version,
)
from trainguard.core.contracts.engine import ReplicaStatus as S
from trainguard.core.fleetauth import Authenticator
from trainguard.core.jsonhttp import HTTPError, JSONHandler, JSONServer
from trainguard.rl.tiny import WORDS
from trainguard.rl.weights import WeightStore

VOCAB = len(WORDS)


def _choices(
    n_seq: int, max_tokens: int, seed: int | list[int] | None, logprobs: bool, n: int = 1
) -> list[dict[str, Any]]:
    """``seed``: an int, or one per prompt (sample ``j`` of prompt ``k`` seeded from
    ``seed[k]`` and ``j``: the same whatever else the request holds)."""
    out = []
    for i in range(n_seq):
        if isinstance(seed, list):
            rng = random.Random(seed[i // n] * 1000 + i % n)
        else:
            rng = random.Random(None if seed is None else seed * 1000 + i)
        ids = [rng.randrange(3, VOCAB) for _ in range(max_tokens)]
        c: dict[str, Any] = {
            "index": i,
            "text": " ".join(WORDS[t] for t in ids),
            "token_ids": ids,
            "finish_reason": "length",
            "logprobs": None,
        }
        if logprobs:
            c["logprobs"] = {"token_logprobs": [-math.log(VOCAB - 3)] * len(ids)}
        out.append(c)
    return out


def _hostile(shape: str, want: int) -> bytes:
    """A completion answer of ``want`` choices, malformed as ``shape`` says."""
    good = _choices(want, 2, 0, True)
    doc: Any = {"choices": good, "weight_version": 0}

    def with_choice(**over: Any) -> Any:
        return {"choices": [{**good[0], **over}, *good[1:]], "weight_version": 0}

    shapes: dict[str, Any] = {
        "mixed_index": {
            "choices": [
                {**c, "index": str(c["index"]) if i == 0 else c["index"]}
                for i, c in enumerate(good)
            ],
            "weight_version": 0,
        },  # fmt: skip
        "string_token": with_choice(token_ids=["7", 3]),
        "negative_token": with_choice(token_ids=[-7, 3]),
        "huge_token": with_choice(token_ids=[10**12, 3]),
        "nan_logprob": with_choice(logprobs={"token_logprobs": [float("nan"), -1.0]}),
        "inf_logprob": with_choice(logprobs={"token_logprobs": [float("-inf"), -1.0]}),
        "huge_version": {"choices": good, "weight_version": 10**400},
        "not_json": None,
        "deep": None,
        "truncated": None,
    }
    if shape == "not_json":
        return b"<html>oops</html>"
    if shape == "deep":
        return b"[" * 100_000 + b"]" * 100_000
    if shape == "truncated":
        raw = json.dumps(doc).encode()
        return raw[: len(raw) // 2]
    return json.dumps(shapes[shape]).encode()


SHAPES = (
    "mixed_index", "string_token", "negative_token", "huge_token", "nan_logprob",
    "inf_logprob", "huge_version", "not_json", "deep", "truncated",
)  # fmt: skip
"""Completion shapes; reward shapes are ``nan_reward``, ``inf_reward``, ``huge_reward``,
``deep``; health shapes ``absurd_inflight``, ``wrong_incarnation``."""


class StubEngine:
    def __init__(self, store: WeightStore, hostile: bool) -> None:
        self.store = store
        self.hostile = hostile
        self.shape = "good"
        self.version: int | None = None
        self.requests = 0
        self.quarantined = False
        self.lock = threading.Lock()

    def status(self) -> S:
        if self.version is None:
            cur = self.store.current()
            if cur is not None:
                self.version = cur.version
        if self.version is None:
            return S.LOADING
        return S.QUARANTINED if self.quarantined else S.SERVING


class Handler(JSONHandler):
    engine: StubEngine
    max_body_bytes = 1 << 20
    get_routes = {HEALTH_PATH: "_health", WEIGHTS_PATH: "_weights", "/control": "_get_control"}
    post_routes = {
        COMPLETIONS_PATH: "_completions",
        WEIGHT_UPDATE_PATH: "_update",
        QUARANTINE_PATH: "_verdict",
        VERIFIED_PATH: "_verdict",
        REWARDS_PATH: "_rewards",
        "/control": "_control",
    }

    def _health(self) -> None:
        e = self.engine
        me = own_identity()
        h = HealthAnswer(
            e.status(), e.version, 0, me.pid, me.incarnation, "stub", vocab_size=VOCAB
        ).to_json()
        if e.shape == "absurd_inflight":
            h["inflight"] = -(10**9)
        if e.shape == "wrong_incarnation":
            h["incarnation"] = "someone-else"
        self.send_json(200, h)

    def _weights(self) -> None:
        self.send_json(200, {"version": self.engine.version})

    def _get_control(self) -> None:
        self.send_json(200, {"requests": self.engine.requests, "shape": self.engine.shape})

    def _control(self) -> None:
        body = self.read_object()
        with self.engine.lock:
            self.engine.shape = str(body.get("shape"))
            self.engine.requests = 0
        self.send_json(200, {"shape": self.engine.shape})

    def _completions(self) -> None:
        e = self.engine
        body = self.read_object()
        with e.lock:
            e.requests += 1
        check = body.get("refit_check") is True  # a client's refit check: answered quarantined
        if e.status() is not S.SERVING and not (check and e.status() is S.QUARANTINED):
            raise HTTPError(503, f"engine is {e.status()}, not serving")
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if (
            not isinstance(prompts, list)
            or not prompts
            or not all(isinstance(p, str) and p.strip() for p in prompts)
        ):
            raise HTTPError(400, "'prompt' must be a string or a non-empty list of strings")
        n, max_tokens, seed = body.get("n", 1), body.get("max_tokens", 16), body.get("seed")
        if not isinstance(n, int) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 256:
            raise HTTPError(400, "'n' and 'max_tokens' must be integers (max_tokens 1..256)")
        want = len(prompts) * n
        if e.hostile and e.shape in SHAPES:
            self.send_json(200, None, raw=_hostile(e.shape, want))
            return
        if isinstance(seed, list) and (
            len(seed) != len(prompts) or not all(type(x) is int and x >= 0 for x in seed)
        ):
            raise HTTPError(400, "'seed' as a list must hold one integer >= 0 per prompt")
        choices = _choices(want, max_tokens, seed, body.get("logprobs") is not None, n)
        if body.get("prompt_logprobs") is not None:  # one word a token; the first None
            for c in choices:
                words = prompts[c["index"] // n].split()
                c["prompt_token_ids"] = [WORDS.index(w) if w in WORDS else 2 for w in words]
                c["prompt_logprobs"] = [None] + [-math.log(VOCAB - 3)] * (len(words) - 1)
        answer = {"choices": choices, "weight_version": e.version}
        answer["incarnation"] = own_identity().incarnation
        if e.hostile and e.shape == "other_incarnation":  # another process answers the port
            answer["incarnation"] = "someone-else"
        self.send_json(200, answer)

    def _update(self) -> None:
        e = self.engine
        try:
            version = weight_update_version(self.read_object())
        except ValueError as err:
            raise HTTPError(400, str(err)) from None
        if e.hostile and e.shape in ("deep", "not_json", "huge_version"):
            self.send_json(200, None, raw=_hostile(e.shape, 1))
            return
        if not e.store.path_of(version).exists():
            raise HTTPError(404, f"weight version {version} is not in {e.store.root}")
        e.version = version
        self.send_json(200, {"version": version, "load_s": 0.0})

    def _verdict(self) -> None:
        """A client's refit check: quarantined (503 but to checks) until a version is verified."""
        e = self.engine
        version = self.read_object().get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise HTTPError(400, "'version' (the weight version checked) is required")
        if self.path == QUARANTINE_PATH:
            e.quarantined = e.version is not None
        elif version != e.version:
            raise HTTPError(409, f"this engine holds weight version {e.version}, not {version}")
        else:
            e.quarantined = False
        self.send_json(200, {"status": e.status().value, "version": e.version})

    def _rewards(self) -> None:
        e = self.engine
        body = self.read_object()
        with e.lock:
            e.requests += 1
        count = len(body.get("prompts") or [])
        bad = {
            "nan_reward": b'{"rewards": [' + b",".join([b"NaN"] * count) + b"]}",
            "inf_reward": b'{"rewards": [' + b",".join([b"1e999"] * count) + b"]}",
            "huge_reward": b'{"rewards": [' + b",".join([b"9" * 400] * count) + b"]}",
            "deep": b"[" * 100_000 + b"]" * 100_000,
        }
        if e.hostile and e.shape in bad:
            self.send_json(200, None, raw=bad[e.shape])
            return
        self.send_json(200, {"rewards": [0.5] * count})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.stub_engine")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--weights-dir", required=True)
    p.add_argument("--hostile", action="store_true")
    a = p.parse_args(argv)
    engine = StubEngine(WeightStore(Path(a.weights_dir)), a.hostile)
    token = os.environ.get("TRAINGUARD_AGENT_ROLE_TOKEN")  # the job's: every request signed with it
    auth = Authenticator("rollout", token) if token else None
    handler = type("StubHandler", (Handler,), {"engine": engine, "authenticator": auth})
    try:
        server = JSONServer(("127.0.0.1", a.port), handler)
    except OSError as e:
        print(f"stub engine: cannot bind port {a.port}: {e.strerror}", file=sys.stderr)
        return 2
    print(f"stub engine pid {os.getpid()} on port {a.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
