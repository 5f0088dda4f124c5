"""The pager and the Grafana push with secrets at stake, against real local HTTP(S) servers:

- the pager's bearer token never follows a redirect to another host (a real server on
  127.0.0.1 redirecting to one on 127.0.0.2), the webhook URL's secret parts are never logged,
  its retry backoff is capped and ``close()`` returns within its bound while a page retries;
- ``dashboards push``: credentials in ``--url`` are refused and never echoed; ``?verify=false``
  is refused (a real HTTPS server whose certificate no CA here trusts), ``--insecure`` says
  out loud that it skips the verification.
"""

from __future__ import annotations

import logging
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.launch_utils import REPO, base_env
from tests.test_dashboards_units import FakeGrafana
from trainguard.core.config.alerts import AlertsConfig
from trainguard.dashboards.pager import MAX_BACKOFF_S, Page, Pager
from trainguard.testing.etcd import make_certs
from trainguard.testing.ports import free_port


class _Server:
    """A real HTTP server on ``host``: records every request; redirects them when told."""

    def __init__(self, host: str, *, redirect: str | None = None, status: int = 302) -> None:
        self.got: list[tuple[str, str, dict[str, str]]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                outer.got.append((self.command, self.path, dict(self.headers)))
                if redirect:
                    self.send_response(status)
                    self.send_header("Location", redirect)
                else:
                    self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = _any  # noqa: N815 - http.server's names

            def log_message(self, *a: object) -> None:
                pass

        self.srv = ThreadingHTTPServer((host, 0), H)
        self.port = int(self.srv.server_address[1])
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def _page() -> Page:
    return Page("trainguard/j/n1/stopped", "TrainGuardJobStopped", "firing", "stopped", {})


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_the_bearer_token_never_follows_a_redirect(
    status: int, caplog: pytest.LogCaptureFixture
) -> None:
    other = _Server("127.0.0.2")  # another host
    hook = _Server("127.0.0.1", redirect=f"http://127.0.0.2:{other.port}/collect", status=status)
    try:
        url = f"http://127.0.0.1:{hook.port}/hooks/S3CRET-PATH?token=S3CRET-Q"
        caplog.set_level(logging.INFO)
        pager = Pager(AlertsConfig(webhook_url=url, max_retries=3, retry_backoff_s=0.01),
                      secret="B3ARER")  # fmt: skip
        assert pager.submit(_page())
        pager.close(timeout_s=10)
        assert other.got == [], other.got  # nothing reached the other host
        assert len(hook.got) == 1  # and a redirect is not retried
        assert hook.got[0][2].get("Authorization") == "Bearer B3ARER"
        assert pager.num_failed == 1 and pager.num_sent == 0
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "redirect, not followed" in text
        assert "S3CRET" not in text and "B3ARER" not in text
        assert f"http://127.0.0.1:{hook.port}/..." in text
    finally:
        hook.close()
        other.close()


def test_backoff_is_capped() -> None:
    sleeps: list[float] = []
    cfg = AlertsConfig(webhook_url="http://x/hook", max_retries=7, retry_backoff_s=10.0)
    pager = Pager(cfg, send=lambda *a: 503, sleep=sleeps.append)
    pager.submit(_page())
    pager.close(timeout_s=60)
    assert sleeps == [10.0, 20.0, 30.0, 30.0, 30.0, 30.0, 30.0] and MAX_BACKOFF_S == 30.0


def test_close_does_not_wait_for_the_whole_retry_cycle(caplog: pytest.LogCaptureFixture) -> None:
    """A receiver that is down (nothing listens): the page is in a 2-s..64-s backoff when the
    agent closes; close() ends within its bound (2 x the request timeout), not ~2 minutes."""
    cfg = AlertsConfig(webhook_url=f"http://127.0.0.1:{free_port()}/hook", timeout_s=1.0,
                       max_retries=6, retry_backoff_s=2.0)  # fmt: skip
    caplog.set_level(logging.INFO)
    pager = Pager(cfg)
    assert pager.submit(_page())
    time.sleep(0.5)  # the first try failed: it waits for the next
    t0 = time.monotonic()
    pager.close()
    assert time.monotonic() - t0 < 5
    assert pager.num_failed == 1 and pager.num_sent == 0
    assert "could not be sent" in "\n".join(r.getMessage() for r in caplog.records)


# -- dashboards push --------------------------------------------------------------------------------
def _push(*args: str, token: str = "s3cret") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainguard", "dashboards", "push", *args],
        cwd=REPO, env=base_env(TRAINGUARD_GRAFANA_TOKEN=token), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_credentials_in_the_url_are_refused_and_never_echoed() -> None:
    g = FakeGrafana("s3cret")
    try:
        port = g.url.rsplit(":", 1)[1]
        for url in (f"http://admin:hunter2@127.0.0.1:{port}",
                    f"http://admin:hunter2@127.0.0.1:{free_port()}"):  # fmt: skip
            p = _push("--url", url)
            out = p.stdout + p.stderr
            assert p.returncode == 1 and "hunter2" not in out, out
            assert "credentials in the URL are refused" in p.stderr
            assert len(p.stderr.strip().splitlines()) == 1
        assert g.requests == []
        # a refused push names the host, never the path or the token
        p = _push("--url", g.url + "/grafana-behind/a-proxy", token="wrong-tok3n")
        assert p.returncode == 1 and "wrong-tok3n" not in p.stderr and "a-proxy" not in p.stderr
    finally:
        g.close()


def test_verify_false_in_the_url_is_refused_insecure_is_said_out_loud(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")  # a CA no trust store here knows
    g = FakeGrafana("s3cret")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(certs["server_cert"]), str(certs["server_key"]))
    g.srv.socket = ctx.wrap_socket(g.srv.socket, server_side=True)
    url = g.url.replace("http://", "https://")
    try:
        p = _push("--url", url + "?verify=false")
        assert p.returncode == 1 and "--insecure" in p.stderr, p.stderr
        assert g.requests == []  # refused before anything was sent
        p = _push("--url", url)  # verified: the unknown CA fails the push
        assert p.returncode == 1 and "cannot reach Grafana" in p.stderr
        assert g.requests == []
        p = _push("--url", url, "--insecure")
        assert p.returncode == 0, p.stderr
        assert "--insecure: Grafana's TLS certificate is not verified" in p.stderr
        assert len(g.dashboards) == 2
    finally:
        g.close()
