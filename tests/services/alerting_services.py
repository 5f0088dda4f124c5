"""Real Prometheus (with rules and alerting) and Alertmanager on loopback, and a webhook receiver.

Debian's ``prometheus`` and ``prometheus-alertmanager`` are installed when missing. Fast
settings: scrape and evaluation every second, alert resend 1 s, Alertmanager
group_wait 0 s / group_interval 1 s, no HA gossip. Every process is started in its own
session and stopped by its PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.services.telemetry_services import apt_ensure, free_port, wait_until


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


class _Daemon:
    def __init__(self, cmd: list[str], log: Path) -> None:
        self.log_path = log
        with log.open("w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def check_alive(self, what: str) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {self.log_path.read_text()[-3000:]}")


class Alertmanager(_Daemon):
    def __init__(self, workdir: Path, config_text: str) -> None:
        apt_ensure("prometheus-alertmanager")
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        cfg = workdir / "alertmanager.yml"
        cfg.write_text(config_text)
        super().__init__(
            ["/usr/bin/prometheus-alertmanager", f"--config.file={cfg}",
             f"--storage.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--cluster.listen-address=", "--log.level=warn"],
            workdir / "alertmanager.log",
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        wait_until(self._ready, 60, "alertmanager ready")

    def _ready(self) -> bool:
        self.check_alive("alertmanager")
        with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
            return r.status == 200

    def alerts(self, **filters: str) -> list[dict[str, Any]]:
        q = urllib.parse.urlencode(filters)
        return _get_json(f"{self.url}/api/v2/alerts?{q}")

    def post_alerts(self, alerts: list[dict[str, Any]]) -> None:
        req = urllib.request.Request(
            self.url + "/api/v2/alerts", data=json.dumps(alerts).encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200


class PrometheusRules(_Daemon):
    """Prometheus scraping ``targets`` (scrape job → host:port list), evaluating ``rule_files``
    every second and sending alerts to ``alertmanager_url`` (if any)."""

    def __init__(
        self,
        workdir: Path,
        targets: dict[str, list[str]],
        *,
        rule_files: list[Path] = (),  # type: ignore[assignment]
        alertmanager_url: str | None = None,
    ) -> None:
        apt_ensure("prometheus")
        workdir.mkdir(parents=True, exist_ok=True)
        self.dir = workdir
        self.port = free_port()
        cfg: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": ts}]}
                for job, ts in targets.items()
            ],
        }  # fmt: skip
        if alertmanager_url:
            host = alertmanager_url.split("://", 1)[1]
            cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [host]}]}]}
        (workdir / "prometheus.yml").write_text(json.dumps(cfg))
        super().__init__(
            ["/usr/bin/prometheus", f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--rules.alert.resend-delay=1s",
             "--log.level=warn"],
            workdir / "prometheus.log",
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        wait_until(self._ready, 60, "prometheus ready")

    def _ready(self) -> bool:
        self.check_alive("prometheus")
        with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
            return r.status == 200

    def query(self, promql: str) -> list[dict[str, Any]]:
        q = urllib.parse.urlencode({"query": promql})
        body = _get_json(f"{self.url}/api/v1/query?{q}")
        assert body["status"] == "success", body
        return body["data"]["result"]

    def query_range(self, promql: str, start: float, end: float, step: float = 1.0) -> Any:
        q = urllib.parse.urlencode({"query": promql, "start": start, "end": end, "step": step})
        try:
            body = _get_json(f"{self.url}/api/v1/query_range?{q}")
        except urllib.error.HTTPError as e:
            raise AssertionError(f"query failed ({e.read().decode()[:500]}): {promql}") from None
        assert body["status"] == "success", body
        return body["data"]["result"]

    def targets_up(self) -> dict[str, float]:
        return {r["metric"]["instance"]: float(r["value"][1]) for r in self.query("up")}


class WebhookReceiver:
    """A real HTTP server on 127.0.0.1 recording every POSTed JSON body with its arrival time."""

    def __init__(self) -> None:
        self.got: list[tuple[float, str, dict[str, Any]]] = []
        self.cond = threading.Condition()
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.cond:
                    outer.got.append((time.time(), self.path, body))
                    outer.cond.notify_all()
                self.send_response(202)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *a: object) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()
        self.base = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def wait_for(self, pred: Any, timeout: float, what: str) -> tuple[float, str, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for item in self.got:
                    if pred(item):
                        return item
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {what} after {timeout:.0f} s; got {self.got!r:.3000}")
                self.cond.wait(min(left, 0.5))

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()
        self.thread.join(timeout=5)
