"""The one JSON-over-HTTP server and client of trainguard's engine fleets (the embedded engine,
the reward server, the adapters, and the clients and probes that call them).

Server (:class:`JSONServer` with a :class:`JSONHandler` subclass): request bodies capped
(``max_body_bytes``: 413 with the reason, the body never read), a socket timeout on every
connection (``timeout``: a client that stops sending is dropped), concurrent connections
bounded (``max_connections``: the next one gets 503 with the reason and is closed), JSON
bounded in depth, one error schema (``{"error": {"message", "type", "code"}}``), and one
request check before any dispatch: :meth:`JSONHandler.authorize`.

Client (:func:`request`): a timeout on every socket operation and a deadline for the whole
answer, the answer's size capped (``max_bytes``), and every transport failure one
:class:`TransportError` with a reason (``refused``, ``timeout``, ``connection``,
``too_large``).
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

from trainguard.core.fleetauth import ANSWER_HEADER, Authenticator, answer_ok, sign

__all__ = [
    "HTTPError",
    "JSONHandler",
    "JSONServer",
    "Response",
    "TransportError",
    "error_body",
    "loads_bounded",
    "request",
]

logger = logging.getLogger(__name__)

MAX_REQUEST_DEPTH = 16


class HTTPError(Exception):
    """Raised by a route: answered as ``code`` with ``message`` in the error schema."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def error_body(code: int, message: str) -> dict[str, Any]:
    """The error schema every server of the contract answers with."""
    kind = "invalid_request_error" if code < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": code}}


def loads_bounded(raw: bytes | str, *, max_depth: int = MAX_REQUEST_DEPTH) -> Any:
    """``json.loads`` that raises ValueError (never RecursionError) for JSON nested deeper
    than ``max_depth``."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
    stack: list[tuple[object, int]] = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            if d > max_depth:
                raise ValueError(f"JSON nested deeper than {max_depth} levels")
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return obj


class JSONHandler(BaseHTTPRequestHandler):
    """Routes (``GET``/``POST`` path → method name) of a JSON server; subclasses set
    ``get_routes``/``post_routes`` and write their routes with :meth:`read_json`,
    :meth:`send_json` and :class:`HTTPError`."""

    protocol_version = "HTTP/1.1"
    server_version = "trainguard"
    timeout = 30.0
    """Seconds any socket operation of a connection may take (a stalled client is dropped)."""
    max_body_bytes = 1 << 20
    """The largest request body read; a larger ``Content-Length`` is answered 413."""
    get_routes: ClassVar[Mapping[str, str]] = {}
    post_routes: ClassVar[Mapping[str, str]] = {}

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    # -- the one request check ---------------------------------------------------------------
    authenticator: Authenticator | None = None
    """Set on a server's handler class: every request must be signed with the job's token
    (:mod:`trainguard.core.fleetauth`); None: every request is allowed."""
    auth_refusal: str | None = None

    def authorize(self) -> bool:
        """Whether this request may be served (called before any route, health included);
        False: answered 401 with :attr:`auth_refusal`, the body never read."""
        if self.authenticator is None:
            return True
        self.auth_refusal = self.authenticator.authorize(self)
        return self.auth_refusal is None

    # -- dispatch ----------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._dispatch("GET", self.get_routes)

    def do_POST(self) -> None:
        self._dispatch("POST", self.post_routes)

    def _dispatch(self, method: str, routes: Mapping[str, str]) -> None:
        try:
            if not self.authorize():
                self.close_connection = True
                raise HTTPError(
                    401, self.auth_refusal or "unauthorized: this server needs the job's token"
                )
            name = routes.get(self.path.split("?", 1)[0])
            if name is None:
                raise HTTPError(404, f"no such endpoint: {method} {self.path[:200]}")
            getattr(self, name)()
        except HTTPError as e:
            self.send_error_json(e.code, e.message)
        except (TimeoutError, ConnectionError):  # the client went away or stalled
            self.close_connection = True
        except Exception as e:  # a bug in a route answers 500, never kills the server
            logger.exception("%s %s failed", method, self.path)
            self.send_error_json(500, f"internal error: {type(e).__name__}: {e}")

    # -- bodies ------------------------------------------------------------------------------
    def read_body(self) -> bytes:
        """The request body, at most ``max_body_bytes`` (413 otherwise, unread)."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self.close_connection = True
            raise HTTPError(411, "send the request body with a Content-Length, not chunked")
        raw_len = self.headers.get("Content-Length") or "0"
        if not raw_len.isdigit() or len(raw_len) > 18:
            self.close_connection = True
            raise HTTPError(400, f"Content-Length {raw_len[:30]!r} is not a byte count")
        n = int(raw_len)
        if n > self.max_body_bytes:
            self.close_connection = True  # the body is never read: the connection ends
            raise HTTPError(
                413,
                f"request body of {n} bytes is larger than this server's limit of "
                f"{self.max_body_bytes} bytes; send smaller requests",
            )
        raw = self.rfile.read(n) if n else b""
        if not Authenticator.body_ok(self, raw):
            raise HTTPError(400, "the request body is not the one its signature names")
        return raw

    def read_json(self) -> Any:
        """The request body as bounded JSON (``null`` when empty); 400 when it is not."""
        raw = self.read_body()
        try:
            return loads_bounded(raw or b"null")
        except ValueError as e:
            raise HTTPError(400, f"the request body is not JSON ({str(e)[:120]})") from None

    def read_object(self) -> dict[str, Any]:
        body = self.read_json()
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        return body

    def send_json(self, code: int, payload: object, *, raw: bytes | None = None) -> None:
        data = raw if raw is not None else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in Authenticator.answer_header(self, code, data).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, code: int, message: str) -> None:
        try:
            self.send_json(code, error_body(code, message))
        except OSError:  # the client is gone
            self.close_connection = True


class JSONServer(ThreadingHTTPServer):
    """A threading HTTP server with at most ``max_connections`` connections open at once
    (the next is answered 503 and closed)."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        max_connections: int = 64,
    ) -> None:
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        body = json.dumps(
            error_body(
                503,
                f"server busy: {self.max_connections} connections open, its limit; "
                "retry later or on another server",
            )
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        try:
            request.settimeout(1.0)
            request.sendall(head + body)
        except OSError:
            pass
        self.shutdown_request(request)


# -- client ------------------------------------------------------------------------------------
class TransportError(Exception):
    """No usable HTTP answer: ``reason`` is ``refused``, ``timeout``, ``connection``,
    ``too_large`` or ``malformed`` (not signed with the job's token)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes


def request(
    host: str,
    port: int,
    method: str,
    path: str,
    body: object = None,
    *,
    timeout: float,
    max_bytes: int,
    headers: Mapping[str, str] | None = None,
    token: str | None = None,
    verify_answer: bool = True,
) -> Response:
    """One JSON request; the answer's status and at most ``max_bytes`` of body, read within
    ``timeout`` per socket operation and ``2 × timeout`` in all. :class:`TransportError`
    for anything else. With the role's ``token``: the request signed, and (``verify_answer``)
    an answer other than a 401 not signed with it is a :class:`TransportError` ``malformed``."""
    deadline = time.monotonic() + 2 * timeout
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        sig = sign(token, method, path, port, data)
        hdrs.update(sig)
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        declared = resp.getheader("Content-Length") or ""
        if declared.isdigit() and int(declared) > max_bytes:
            raise TransportError("too_large", f"answer of {declared} bytes (limit {max_bytes})")
        chunks: list[bytes] = []
        got = 0
        while True:
            chunk = resp.read1(min(1 << 20, max_bytes + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
            if got > max_bytes:
                raise TransportError("too_large", f"answer of more than {max_bytes} bytes")
            if time.monotonic() > deadline:
                raise TransportError("timeout", f"answer not complete in {2 * timeout:g} s")
        raw = b"".join(chunks)
        if (
            verify_answer
            and resp.status != 401
            and not answer_ok(token, sig, resp.status, raw, resp.getheader(ANSWER_HEADER))
        ):
            raise TransportError(
                "malformed",
                "the answer is not signed with the job's token (another process on the port?)",
            )
        return Response(resp.status, raw)
    except ConnectionRefusedError as e:
        raise TransportError("refused", str(e)) from None
    except TimeoutError as e:
        raise TransportError("timeout", f"no answer in {timeout:g} s ({e})") from None
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise TransportError("connection", f"{type(e).__name__}: {str(e)[:200]}") from None
    finally:
        conn.close()
