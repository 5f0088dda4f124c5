"""Find, start and stop a torchft lighthouse on 127.0.0.1 (``trainguard run --ft``)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from trainguard.core.atomicfile import open_append
from trainguard.core.config.ft import FTConfig

__all__ = ["FTUnavailable", "Lighthouse", "ensure_lighthouse", "reachable", "torchft_error"]

logger = logging.getLogger(__name__)

LIGHTHOUSE_BINARY = "torchft_lighthouse"


class FTUnavailable(RuntimeError):
    """torchft mode cannot run here; the message is one line with the cause and the fix."""


def torchft_error() -> str | None:
    """Why ``import torchft`` fails here (one line), or None when it imports."""
    try:
        import torchft  # noqa: F401
    except Exception as e:  # ImportError, or a broken build (e.g. an ABI mismatch with torch)
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def _listener_uid(host: str, port: int) -> int | None:
    """The uid owning the TCP socket listening on ``host:port`` (IPv4), from /proc/net/tcp;
    None where that cannot be told (no /proc, no such listener)."""
    want = f"{socket.inet_aton(host)[::-1].hex().upper()}:{port:04X}"
    anywhere = f"00000000:{port:04X}"
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        cols = line.split()
        if len(cols) > 7 and cols[3] == "0A" and cols[1] in (want, anywhere):
            return int(cols[7])
    return None


def is_lighthouse(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether a torchft lighthouse answers at ``host:port``: its HTTP status page (served on
    the same port as its gRPC API) names it."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy
    try:
        with direct.open(f"http://{host}:{port}/", timeout=timeout_s) as r:
            return r.status == 200 and b"Lighthouse" in r.read(4096)
    except (OSError, ValueError):
        return False


def _trusted(host: str, port: int) -> None:
    """Refuse a listener on the lighthouse port that is not this user's torchft lighthouse."""
    uid = _listener_uid(host, port)
    if uid is not None and uid != os.geteuid():
        raise FTUnavailable(
            f"torchft mode: {host}:{port} is held by another user's process (uid {uid}), not a "
            "lighthouse this job can trust: set [ft] lighthouse_port to a free port, or [ft] "
            "lighthouse to the URL of a lighthouse you run"
        )
    if not is_lighthouse(host, port):
        raise FTUnavailable(
            f"torchft mode: something that is not a torchft lighthouse listens on {host}:{port}: "
            "set [ft] lighthouse_port to a free port, or [ft] lighthouse to a lighthouse's URL"
        )


def _lock_dir() -> Path | None:
    """A directory only this user can write (``$XDG_RUNTIME_DIR``, else
    ``<tmp>/trainguard-<uid>``, made 0700): another user can neither create nor hold the
    lock there. None when no such directory can be had."""
    uid = os.geteuid()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    for d in ([Path(runtime)] if runtime else []) + [
        Path(tempfile.gettempdir()) / f"trainguard-{uid}"
    ]:
        try:
            d.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(d)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022:
            return d
    return None


@contextlib.contextmanager
def _host_lock(port: int, timeout_s: float) -> Iterator[None]:
    """Launchers of this user on this host check-and-start the lighthouse of ``port`` one at a
    time; after ``timeout_s`` (a stuck launcher holds it) they go on without the lock, which
    only costs a lost race (a second lighthouse that cannot bind, and exits)."""
    d = _lock_dir()
    if d is None:
        logger.warning("no private directory for the lighthouse lock: starting without it")
        yield
        return
    with os.fdopen(open_append(d / f"ft-lighthouse-{port}.lock"), "a") as lock:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    logger.warning(
                        "the lighthouse lock %s is held for over %.0f s: going on without it",
                        lock.name,
                        timeout_s,
                    )
                    yield
                    return
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def reachable(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """Whether something accepts TCP connections at host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


@dataclass
class Lighthouse:
    """A lighthouse in use: ``pid`` is set only when this process started it (and stops it)."""

    url: str
    pid: int | None = None
    log: Path | None = None
    _proc: subprocess.Popen[bytes] | None = None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the lighthouse this process started (by PID, its process group); else no-op."""
        if self.pid is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                break
            if self._proc is None:
                break
            try:
                self._proc.wait(timeout=timeout_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.pid = None


def _binary() -> str:
    beside = Path(sys.executable).parent / LIGHTHOUSE_BINARY
    if beside.is_file():
        return str(beside)
    found = shutil.which(LIGHTHOUSE_BINARY)
    if found:
        return found
    raise FTUnavailable(
        f"torchft mode: {LIGHTHOUSE_BINARY} not found next to {sys.executable} or on PATH: "
        'pip install torchft==0.2.0, or give a running one with [ft] lighthouse = "http://host:port"'
    )


def ensure_lighthouse(
    cfg: FTConfig, log_dir: Path, *, start_timeout_s: float = 60.0, lock_timeout_s: float = 30.0
) -> Lighthouse:
    """The lighthouse this job uses: ``cfg.lighthouse`` if set; else this user's lighthouse
    already listening on 127.0.0.1:``cfg.lighthouse_port`` (checked: its status page, the
    socket's owner); else a new one started there (this process stops it)."""
    error = torchft_error()
    if error is not None:
        raise FTUnavailable(
            f"torchft mode needs torchft: import torchft failed ({error}); "
            "pip install torchft==0.2.0 (or 'trainguard[ft]')"
        )
    if cfg.lighthouse:
        parts = urlsplit(cfg.lighthouse)
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
            raise FTUnavailable(
                f"[ft] lighthouse = {cfg.lighthouse!r} is not a URL: use http://HOST:PORT"
            )
        return Lighthouse(url=cfg.lighthouse)
    host, port = "127.0.0.1", cfg.lighthouse_port
    # Launchers of the replica groups on this host check-and-start under one lock: the second
    # finds the first one's lighthouse instead of racing it for the port.
    with _host_lock(port, lock_timeout_s):
        return _find_or_start(cfg, host, port, log_dir, start_timeout_s)


def _find_or_start(
    cfg: FTConfig, host: str, port: int, log_dir: Path, start_timeout_s: float
) -> Lighthouse:
    url = f"http://{host}:{port}"
    if reachable(host, port):
        _trusted(host, port)
        return Lighthouse(url=url)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"ft_lighthouse_{port}.log"
    cmd = [
        _binary(),
        "--bind",
        f"{host}:{port}",
        "--min_replicas",
        str(cfg.min_replicas),
        "--heartbeat_timeout_ms",
        str(cfg.heartbeat_timeout_ms),
        "--join_timeout_ms",
        str(cfg.join_timeout_ms),
        "--quorum_tick_ms",
        str(cfg.quorum_tick_ms),
    ]
    with os.fdopen(open_append(log), "ab") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        if reachable(host, port):
            if proc.poll() is not None:  # lost a race: another launcher's lighthouse is up
                _trusted(host, port)
                return Lighthouse(url=url)
            return Lighthouse(url=url, pid=proc.pid, log=log, _proc=proc)
        if proc.poll() is not None and not reachable(host, port):
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise FTUnavailable(
                f"torchft mode: the lighthouse on {host}:{port} exited with {proc.returncode} "
                f"({tail[0]}); see {log} or set [ft] lighthouse_port"
            )
        time.sleep(0.05)
    Lighthouse(url=url, pid=proc.pid, _proc=proc).stop()
    raise FTUnavailable(
        f"torchft mode: the lighthouse on {host}:{port} did not listen within "
        f"{start_timeout_s:.0f} s; see {log}"
    )
