"""A real etcd 3.4 (Debian ``etcd-server``) on loopback with free ports, for tests and benchmarks.

Started in its own process group, stopped by its PID (SIGTERM, then SIGKILL); ``stop()`` and
``start()`` again on the same data directory is an etcd restart (the fault the etcd-v3
rendezvous must survive).
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from trainguard.testing.net import wait_until
from trainguard.testing.ports import free_port

ETCD = "/usr/bin/etcd"


class Etcd:
    """One etcd member; ``endpoint`` is ``127.0.0.1:<client port>``."""

    def __init__(
        self,
        workdir: Path,
        *,
        no_fsync: bool = False,
        extra_args: list[str] | None = None,
        tls: dict[str, Path] | None = None,
    ) -> None:
        if not os.path.exists(ETCD):
            raise RuntimeError(f"{ETCD} not found: apt-get install etcd-server")
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://{self.endpoint}"
        self.no_fsync = no_fsync
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self.on_start: Callable[[int], None] | None = None
        """Called with the PID of each start after this one (a fixture that owns the member
        registers its restarts)."""
        self._started = False
        self.start()

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "etcd is already running"
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            ETCD, "--name", "tg", "--data-dir", str(self.dir / "data"),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"tg={peer}",
            "--initial-cluster-state", "existing" if self._started else "new",
            "--logger", "zap", "--log-level", "warn",
        ]  # fmt: skip
        if self.no_fsync:
            args.append("--unsafe-no-fsync")
        if self.tls:
            args += [
                "--cert-file", str(self.tls["server_cert"]),
                "--key-file", str(self.tls["server_key"]),
                "--trusted-ca-file", str(self.tls["ca"]),
                "--client-cert-auth",
            ]  # fmt: skip
        args += self.extra_args
        log = (self.dir / "etcd.log").open("ab")
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        if self.on_start is not None:
            self.on_start(self.proc.pid)
        self._started = True
        wait_until(self._healthy, 60, f"etcd healthy on {self.endpoint}", interval=0.1)

    def _healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            tail = (self.dir / "etcd.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"etcd exited: {tail}")
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(cafile=str(self.tls["ca"]))
            ctx.load_cert_chain(str(self.tls["client_cert"]), str(self.tls["client_key"]))
        with urllib.request.urlopen(self.url + "/health", timeout=2, context=ctx) as r:
            return b'"true"' in r.read()

    def stop(self) -> None:
        """Stop this member by its PID (its data directory stays)."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def wait_stopped(self, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while self.proc is not None and self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError("etcd did not stop")
            time.sleep(0.05)


def make_certs(d: Path) -> dict[str, Path]:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate (openssl)."""
    d.mkdir(parents=True, exist_ok=True)

    def ssl_(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ssl_("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=tg-test-ca",
         "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        ssl_("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
        ssl_("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", "san.cnf", "-out", f"{name}.pem")  # fmt: skip
    return {
        "ca": d / "ca.pem",
        "server_cert": d / "server.pem",
        "server_key": d / "server.key",
        "client_cert": d / "client.pem",
        "client_key": d / "client.key",
    }
