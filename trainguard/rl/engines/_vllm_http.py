"""The HTTP side of the vLLM adapter: the engine contract's endpoints on the shared JSON server
(:mod:`trainguard.core.jsonhttp`)."""

from __future__ import annotations

import json
from typing import Any, Protocol

from trainguard.core.contracts.engine import (
    COMPLETIONS_PATH,
    HEALTH_PATH,
    MODELS_PATH,
    QUARANTINE_PATH,
    VERIFIED_PATH,
    WEIGHT_UPDATE_PATH,
    WEIGHTS_PATH,
    weight_update_version,
)
from trainguard.core.contracts.engine import ReplicaStatus as S
from trainguard.core.fleetauth import Authenticator
from trainguard.core.jsonhttp import HTTPError, JSONHandler, JSONServer

__all__ = ["AdapterError", "make_server"]


class AdapterError(HTTPError):
    """An answer with HTTP status ``code`` and a one-line ``message`` (what, where, the fix)."""


class _Config(Protocol):
    model: str
    fault_injection: bool


class _Adapter(Protocol):
    auth: Authenticator | None
    status: S

    @property
    def config(self) -> _Config: ...
    @property
    def version(self) -> int | None: ...

    def health(self) -> dict[str, Any]: ...
    def complete(self, body: object) -> dict[str, Any]: ...
    def refit(self, version: int) -> float: ...
    def arm_fault(self, kind: str, count: int) -> None: ...
    def quarantine(self, version: int | None, reason: str) -> None: ...
    def verified(self, version: int) -> bool: ...


class _Handler(JSONHandler):
    server_version = "trainguard-vllm-adapter"
    max_body_bytes = 8 << 20
    adapter: _Adapter
    get_routes = {HEALTH_PATH: "_health", WEIGHTS_PATH: "_weights", MODELS_PATH: "_models"}
    post_routes = {
        COMPLETIONS_PATH: "_completions",
        WEIGHT_UPDATE_PATH: "_update",
        QUARANTINE_PATH: "_verdict",
        VERIFIED_PATH: "_verdict",
        "/v1/faults": "_faults",
    }

    def _health(self) -> None:
        self.send_json(200, self.adapter.health())

    def _weights(self) -> None:
        self.send_json(200, {"version": self.adapter.version})

    def _models(self) -> None:
        model = self.adapter.config.model
        self.send_json(200, {"object": "list", "data": [{"id": model, "object": "model"}]})

    def _completions(self) -> None:
        ans = self.adapter.complete(self.read_json())
        if ans.pop("truncate", False):  # fault injection: a torn answer
            data = json.dumps(ans).encode()
            self.send_json(200, None, raw=data[: len(data) // 2])
        else:
            self.send_json(200, ans)

    def _faults(self) -> None:
        if not self.adapter.config.fault_injection:
            raise HTTPError(404, f"no such endpoint: POST {self.path}")
        body = self.read_object()
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise HTTPError(400, "'count' must be an integer >= 0")
        self.adapter.arm_fault(str(body.get("kind")), count)
        self.send_json(200, {"armed": body.get("kind")})

    def _verdict(self) -> None:
        """``POST /v1/weights/quarantine`` ``{"version", "reason"}`` / ``/v1/weights/verified``
        ``{"version"}``: a client's refit check of this engine."""
        a = self.adapter
        body = self.read_object()
        version = body.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise AdapterError(400, "'version' (the weight version checked) is required")
        if self.path == QUARANTINE_PATH:
            a.quarantine(version, str(body.get("reason", ""))[:500])
        elif not a.verified(version):
            raise AdapterError(409, f"this engine holds weight version {a.version}, not {version}")
        self.send_json(200, {"status": S(a.status).value, "version": a.version})

    def _update(self) -> None:
        a = self.adapter
        try:
            version = weight_update_version(self.read_object())
        except ValueError as err:
            raise AdapterError(400, str(err)) from None
        if a.status in (S.STARTING, S.STANDBY):
            raise AdapterError(503, f"engine is {a.status}; it loads the current version itself")
        load_s = a.refit(version)
        self.send_json(200, {"version": version, "load_s": round(load_s, 6)})


def make_server(adapter: _Adapter, host: str, port: int) -> JSONServer:
    handler = type("Handler", (_Handler,), {"adapter": adapter, "authenticator": adapter.auth})
    return JSONServer((host, port), handler)
