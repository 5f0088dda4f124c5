"""What the benchmarks need around the product's code: ports, their processes' environment, a
throwaway PostgreSQL. Process trees and faults are trainguard's own (:mod:`trainguard.chaos`).

A benchmark runs alone on its machine (not beside the suite's workers), so a free port is the
kernel's, and a launched job's environment is this one without trainguard's and torchrun's
variables.
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

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port nothing holds on 127.0.0.1 now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, timeout: float = 30) -> None:
    """Wait until something accepts connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port} after {timeout}s")


def base_env(**extra: str) -> dict[str, str]:
    """This environment without trainguard's, torchrun's and the agent's variables, this
    checkout on ``PYTHONPATH``, plus ``extra``."""
    from trainguard.core.contracts import envvars

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_", envvars.NAMESPACE))
    }
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise SystemExit(f"{name} not found: apt-get install postgresql")
    return found[-1]


class Postgres:
    """A real PostgreSQL throwaway cluster on 127.0.0.1 (trust authentication for the loopback
    only), stopped by its PID; ``stop()`` then ``start()`` is a database restart. As root it
    runs as the ``postgres`` system user (PostgreSQL refuses root)."""

    def __init__(self, *, max_connections: int = 100) -> None:
        self.user = "postgres" if os.geteuid() == 0 else None
        self.dir = Path(tempfile.mkdtemp(prefix="tg-bench-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.max_connections = max_connections
        self.proc: subprocess.Popen[bytes] | None = None
        if self.user:
            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        subprocess.run(
            [_pg_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8"],
            check=True, capture_output=True, user=self.user, cwd=self.dir,
        )  # fmt: skip
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.start()

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "postgres is already running"
        with open(self.dir / "postgres.log", "ab") as log:
            self.proc = subprocess.Popen(
                [_pg_bin("postgres"), "-D", str(self.data), "-h", "127.0.0.1", "-p", str(self.port),
                 "-c", "unix_socket_directories=", "-c", f"max_connections={self.max_connections}",
                 "-c", "fsync=off", "-c", "shared_buffers=16MB"],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, user=self.user,
                cwd=self.dir, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log_text = (self.dir / "postgres.log").read_text()[-2000:]
                raise RuntimeError(f"postgres exited: {log_text}")
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
