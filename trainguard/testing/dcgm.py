"""A fake dcgm-exporter endpoint for the test suite and benchmarks: :class:`ExporterServer`
serves whatever text a test sets (e.g. :func:`trainguard.chaos.dcgm.h100_node`'s, with
faults)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from trainguard.chaos.dcgm import FIELDS, h100_node

__all__ = ["FIELDS", "ExporterServer", "h100_node", "serve"]


class _Handler(http.server.BaseHTTPRequestHandler):
    body: Callable[[], str]

    def do_GET(self) -> None:  # noqa: N802
        data = self.server.body().encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


class ExporterServer:
    """A real HTTP server on 127.0.0.1 (port 0) serving whatever ``text`` currently holds."""

    def __init__(self, text: str = "") -> None:
        self.text = text
        self._srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._srv.body = lambda: self.text  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._srv.server_address[1]}/metrics"

    def __enter__(self) -> ExporterServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._srv.shutdown()
        self._srv.server_close()
        self._thread.join(timeout=5)


@contextmanager
def serve(text: str) -> Iterator[ExporterServer]:
    with ExporterServer(text) as srv:
        yield srv
