"""The HTTP side of the vLLM adapter: the engine contract's endpoints on a threading server."""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

__all__ = ["AdapterError", "make_server"]

logger = logging.getLogger(__name__)


class AdapterError(Exception):
    """An answer with HTTP status ``code`` and a one-line ``message`` (what, where, the fix)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Adapter(Protocol):
    version: int | None
    status: str
    config: Any

    def health(self) -> dict[str, Any]: ...
    def complete(self, body: Any) -> dict[str, Any]: ...
    def refit(self, version: int) -> float: ...
    def arm_fault(self, kind: str, count: int) -> None: ...


class _Handler(BaseHTTPRequestHandler):
    server_version = "trainguard-vllm-adapter"
    protocol_version = "HTTP/1.1"
    adapter: _Adapter

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def _send(self, code: int, payload: Any, raw: bytes | None = None) -> None:
        data = raw if raw is not None else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str) -> None:
        kind = "invalid_request_error" if code < 500 else "server_error"
        self._send(code, {"error": {"message": message, "type": kind, "code": code}})

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            return json.loads(raw or b"null")
        except ValueError as e:
            raise AdapterError(400, f"the request body is not JSON ({e})") from None

    def do_GET(self) -> None:
        a = self.adapter
        if self.path == "/health":
            self._send(200, a.health())
        elif self.path == "/v1/weights":
            self._send(200, {"version": a.version})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": a.config.model, "object": "model"}]})
        else:
            self._error(404, f"no such endpoint: GET {self.path}")

    def do_POST(self) -> None:
        try:
            if self.path == "/v1/completions":
                ans = self.adapter.complete(self._body())
                if ans.pop("truncate", False):  # fault injection: a torn answer
                    data = json.dumps(ans).encode()
                    self._send(200, None, raw=data[: len(data) // 2])
                else:
                    self._send(200, ans)
            elif self.path == "/v1/weights/update":
                self._update()
            elif self.path == "/v1/faults" and self.adapter.config.fault_injection:
                body = self._body()
                if not isinstance(body, dict):
                    raise AdapterError(400, "the request body must be a JSON object")
                self.adapter.arm_fault(str(body.get("kind")), int(body.get("count", 1)))
                self._send(200, {"armed": body.get("kind")})
            else:
                self._error(404, f"no such endpoint: POST {self.path}")
        except AdapterError as err:
            self._error(err.code, err.message)

    def _update(self) -> None:
        a = self.adapter
        body = self._body()
        version = body.get("version") if isinstance(body, dict) else None
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise AdapterError(400, "'version' (the weight version to load, >= 0) is required")
        if set(body) - {"version"}:
            raise AdapterError(
                400,
                f"unknown fields {sorted(set(body) - {'version'})}: a weight update names only "
                'a version of the job\'s weight store ({"version": v}); publish the weights '
                "there first",
            )
        if a.status in ("starting", "standby"):
            raise AdapterError(503, f"engine is {a.status}; it loads the current version itself")
        load_s = a.refit(version)
        self._send(200, {"version": version, "load_s": round(load_s, 6)})


def make_server(adapter: _Adapter, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"adapter": adapter})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
