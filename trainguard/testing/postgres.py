"""A real PostgreSQL (Debian ``postgresql``) throwaway cluster on loopback, for tests and bench.

``initdb`` into a fresh directory, ``postgres`` on ``127.0.0.1:<free port>`` (no Unix socket,
trust authentication for the loopback only: a test cluster), in its own process group, stopped
by its PID (SIGINT: fast shutdown, then SIGKILL). ``stop()`` then ``start()`` on the same
directory is a database restart (the outage the fleet writer must survive). PostgreSQL refuses
to run as root: as root, the cluster runs as the ``postgres`` system user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from trainguard.testing.ports import free_port


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise RuntimeError(f"{name} not found: apt-get install postgresql")
    return found[-1]


class Postgres:
    def __init__(self, *, max_connections: int = 100) -> None:
        self.user = "postgres" if os.geteuid() == 0 else None
        self.dir = Path(tempfile.mkdtemp(prefix="tg-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.max_connections = max_connections
        self.proc: subprocess.Popen[bytes] | None = None
        if self.user:
            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        subprocess.run(
            [_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8"],
            check=True, capture_output=True, user=self.user, cwd=self.dir,
        )  # fmt: skip
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.start()

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "postgres is already running"
        log = open(self.dir / "postgres.log", "ab")  # noqa: SIM115 - the server's own stderr
        self.proc = subprocess.Popen(
            [_bin("postgres"), "-D", str(self.data), "-h", "127.0.0.1", "-p", str(self.port),
             "-c", "unix_socket_directories=", "-c", f"max_connections={self.max_connections}",
             "-c", "fsync=off", "-c", "shared_buffers=16MB"],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, user=self.user,
            cwd=self.dir, start_new_session=True,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    "postgres exited: " + (self.dir / "postgres.log").read_text()[-2000:]
                )
            if self.ready():
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError("postgres did not accept connections within 60 s")

    def ready(self) -> bool:
        try:
            import psycopg

            with psycopg.connect(self.url, connect_timeout=2) as c:
                c.execute("SELECT 1")
            return True
        except Exception:
            return False

    def listening(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        os.kill(p.pid, signal.SIGINT)  # fast shutdown, by PID
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
