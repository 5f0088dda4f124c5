"""Start real Prometheus / rotel / Chromium for telemetry tests; install them when missing.

Debian packages come from apt-get (idempotent, no daemon started by postinst); rotel comes
from PyPI into its own venv under ``$TRAINGUARD_TEST_CACHE`` (default ``/tmp/trainguard-test-cache``).
Every process started here is stopped by its own handle; every wait has a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from trainguard.testing.net import wait_until as wait_until  # re-exported for the tests
from trainguard.testing.ports import free_port

CACHE = Path(os.environ.get("TRAINGUARD_TEST_CACHE", "/tmp/trainguard-test-cache"))
ROTEL_SPEC = "rotel==0.0.1a15"


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def apt_ensure(*packages: str) -> None:
    """Install missing Debian packages (needs root); never starts their services."""
    missing = []
    for p in packages:
        r = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True, check=False
        )
        if "install ok installed" not in r.stdout:
            missing.append(p)
    if not missing:
        return
    policy = Path("/usr/sbin/policy-rc.d")
    made = False
    if not policy.exists():
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        made = True
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        lists = list(Path("/var/lib/apt/lists").glob("*_Packages"))
        if not lists or min(time.time() - p.stat().st_mtime for p in lists) > 86400:
            subprocess.run(
                ["apt-get", "-o", "DPkg::Lock::Timeout=600", "update", "-q"],
                env=env, check=True, capture_output=True, timeout=900,
            )  # fmt: skip
        subprocess.run(
            ["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y", "-q",
             "--no-install-recommends", *missing],
            env=env, check=True, capture_output=True, timeout=1800,
        )  # fmt: skip
    finally:
        if made:
            policy.unlink()


class Prometheus:
    """A real Prometheus scraping ``targets`` every second."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        apt_ensure("prometheus")
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        cfg = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {"job_name": "trainguard", "static_configs": [{"targets": targets}]}
            ],
        }
        (self.dir / "prometheus.yml").write_text(json.dumps(cfg))  # JSON is valid YAML
        self.log = (self.dir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            ["/usr/bin/prometheus", f"--config.file={self.dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        wait_until(self._ready, 60, "prometheus ready")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {(self.dir / 'prometheus.log').read_text()}")
        with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
            return r.status == 200

    def query(self, promql: str) -> list[dict[str, Any]]:
        q = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=5) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


_ROTEL_PROBE = (
    "import os, rotel; print(os.path.join(os.path.dirname(rotel.__file__), 'rotel-agent'))"
)


def rotel_installed() -> bool:
    py = CACHE / "venv-rotel" / "bin" / "python"
    if not py.exists():
        return False
    r = subprocess.run([str(py), "-c", _ROTEL_PROBE], capture_output=True, text=True, check=False)
    return r.returncode == 0 and Path(r.stdout.strip()).exists()


def rotel_binary() -> Path:
    venv = CACHE / "venv-rotel"
    py = venv / "bin" / "python"
    if not py.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    probe = _ROTEL_PROBE
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "--pre", ROTEL_SPEC],
            check=True, timeout=900,
        )  # fmt: skip
        r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, check=True)
    return Path(r.stdout.strip())


class Rotel:
    """The rotel OTLP receiver (gRPC + HTTP); everything received is logged, decoded, to
    ``self.log_path`` (its debug-log exporter)."""

    def __init__(self, workdir: Path) -> None:
        self.bin = rotel_binary()
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.log_path = self.dir / "rotel.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [str(self.bin), "start",
             "--otlp-grpc-endpoint", f"127.0.0.1:{self.grpc_port}",
             "--otlp-http-endpoint", f"127.0.0.1:{self.http_port}",
             "--debug-log", "traces", "--debug-log", "metrics",
             "--debug-log-verbosity", "detailed",
             "--batch-timeout", "100ms", "--exporter", "blackhole"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        log.close()
        wait_until(
            lambda: port_open(self.grpc_port) and port_open(self.http_port), 30, "rotel ports"
        )

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    apt_ensure("chromium")
    path = shutil.which("chromium")
    assert path, "chromium not on PATH after apt-get install"
    return path


CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
]


def chromium_dump_dom(html: Path, workdir: Path, timeout: float = 90) -> tuple[str, str]:
    """Open ``html`` in headless Chromium; return (DOM after load, stderr with console lines)."""
    profile = workdir / "chromium-profile"
    profile.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        [chromium_binary(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
         "--virtual-time-budget=2000", "--dump-dom", html.resolve().as_uri()],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return r.stdout, r.stderr
