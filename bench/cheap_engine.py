"""A cheap engine for the fleet benchmarks: a real process that speaks the engine contract
(health with its identity, completions, weight updates by version, every request checked
against ``TRAINGUARD_ROLE_TOKEN``) on the shared JSON server, without a model or torch, so
that tens of them fit a small machine where generation is not what is measured.

    python bench/cheap_engine.py --port P --weights-dir D

``loading`` until the weight store's pointer names a version, then ``serving`` it; a
completion is ``max_tokens`` seeded token ids of a 17-word vocabulary with their log-probs.

``--load-delay-s D``: a weight update takes ``D`` seconds, in 20 equal parts (``GET /control``:
``loading`` = the version being loaded, ``progress`` = the share done); ``POST /control
{"hold_at": f}`` makes the next loads stop once ``f`` of them is done (``held`` true) until
``{"hold_at": null}``: a drill kills or freezes an engine at a chosen point of a refit
(bench/refit_drill.py).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainguard.core.contracts.engine import (  # noqa: E402
    COMPLETIONS_PATH,
    HEALTH_PATH,
    WEIGHT_UPDATE_PATH,
    HealthAnswer,
    own_identity,
)
from trainguard.core.contracts.engine import ReplicaStatus as S  # noqa: E402
from trainguard.core.fleetauth import Authenticator  # noqa: E402
from trainguard.core.jsonhttp import HTTPError, JSONHandler, JSONServer  # noqa: E402
from trainguard.rl.weights import WeightStore  # noqa: E402

VOCAB = 17


class Handler(JSONHandler):
    store: WeightStore
    version: int | None = None
    max_body_bytes = 1 << 20
    get_routes = {HEALTH_PATH: "_health", "/control": "_get_control"}
    post_routes = {
        COMPLETIONS_PATH: "_completions",
        WEIGHT_UPDATE_PATH: "_update",
        "/control": "_control",
    }
    load_delay_s = 0.0
    loading: int | None = None
    progress = 0.0
    held = False
    hold_at: float | None = None
    release = threading.Condition()

    def status(self) -> S:
        cls = type(self)
        if cls.version is None:
            cur = self.store.current()
            if cur is not None:
                cls.version = cur.version
        return S.SERVING if cls.version is not None else S.LOADING

    def _health(self) -> None:
        me = own_identity()
        st = self.status()
        h = HealthAnswer(st, self.version, 0, me.pid, me.incarnation, "cheap", vocab_size=VOCAB)
        self.send_json(200, h.to_json())

    def _completions(self) -> None:
        body = self.read_object()
        if self.status() is not S.SERVING:
            raise HTTPError(503, "engine is loading, not serving yet")
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts:
            raise HTTPError(400, "'prompt' must be a string or a non-empty list of strings")
        n, max_tokens, seed = body.get("n", 1), body.get("max_tokens", 16), body.get("seed")
        if not isinstance(n, int) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 256:
            raise HTTPError(400, "'n' and 'max_tokens' must be integers (max_tokens 1..256)")
        choices: list[dict[str, Any]] = []
        for i in range(len(prompts) * n):
            rng = random.Random(None if seed is None else seed * 1000 + i)
            ids = [rng.randrange(3, VOCAB) for _ in range(max_tokens)]
            choices.append(
                {
                    "index": i,
                    "text": " ".join(str(t) for t in ids),
                    "token_ids": ids,
                    "finish_reason": "length",
                    "logprobs": {"token_logprobs": [-math.log(VOCAB - 3)] * len(ids)},
                }
            )
        self.send_json(200, {"choices": choices, "weight_version": self.version})

    def _update(self) -> None:
        version = self.read_object().get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise HTTPError(400, "'version' (the weight version to load) is required")
        if not self.store.path_of(version).exists():
            raise HTTPError(404, f"weight version {version} is not in the store")
        cls = type(self)
        if cls.load_delay_s > 0:
            cls.loading, cls.progress = version, 0.0
            for part in range(1, 21):
                with cls.release:
                    while cls.hold_at is not None and cls.progress >= cls.hold_at:
                        cls.held = True
                        cls.release.wait(0.05)
                    cls.held = False
                time.sleep(cls.load_delay_s / 20)
                cls.progress = part / 20
            cls.loading = None
        cls.version = version
        self.send_json(200, {"version": version, "load_s": cls.load_delay_s})

    def _get_control(self) -> None:
        cls = type(self)
        self.send_json(200, {"loading": cls.loading, "progress": cls.progress,
                             "held": cls.held, "pid": os.getpid()})  # fmt: skip

    def _control(self) -> None:
        hold = self.read_object().get("hold_at")
        cls = type(self)
        with cls.release:
            cls.hold_at = None if hold is None else float(hold)
            cls.release.notify_all()
        self.send_json(200, {"hold_at": cls.hold_at})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/cheap_engine.py")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--weights-dir", required=True)
    p.add_argument("--load-delay-s", type=float, default=0.0)
    a = p.parse_args(argv)
    token = os.environ.get("TRAINGUARD_ROLE_TOKEN")
    auth = Authenticator("rollout", token) if token else None
    handler = type(
        "CheapHandler",
        (Handler,),
        {
            "store": WeightStore(Path(a.weights_dir)),
            "authenticator": auth,
            "version": None,
            "load_delay_s": a.load_delay_s,
            "release": threading.Condition(),
        },  # fmt: skip
    )
    try:
        server = JSONServer(("127.0.0.1", a.port), handler, max_connections=32)
    except OSError as e:
        print(f"cheap engine: cannot bind port {a.port}: {e.strerror}", file=sys.stderr)
        return 2
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
