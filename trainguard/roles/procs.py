"""Process plumbing of the role supervisor: start a replica's process in its own session, end
its process group by PID, tell a slow process from a frozen one, and name the process that
holds a port.

Nothing here knows replicas or standbys: :mod:`trainguard.roles.replica` and
:mod:`trainguard.roles.standby` build on it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.core.atomicfile import open_append

__all__ = [
    "Progress",
    "free_port",
    "kill_group",
    "new_incarnation",
    "port_holder",
    "port_is_free",
    "progress",
    "reap",
    "renice",
    "spawn",
]

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A free port held for a server still to start: a socket bound to it (``SO_REUSEADDR``)
    that never listens. While it is open, no other process is given the port by the kernel
    (an ephemeral bind or connect), and the server, which binds with ``SO_REUSEADDR`` as
    every common HTTP server does, binds and listens on it as if it were free, as often as it
    restarts. A port picked and let go (:func:`free_port`) can be taken by anyone in the
    seconds before the server binds it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host or "0.0.0.0", 0))
    except OSError:
        s.close()
        raise
    return s


def new_incarnation() -> str:
    """A nonce naming one start of one process (given at spawn, answered in its health)."""
    return secrets.token_hex(8)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind ``host:port`` now (as an HTTP server does: SO_REUSEADDR,
    so a closed replica's TIME_WAIT does not count, a listening process does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes


def port_holder(port: int) -> tuple[int | None, str]:
    """The process listening on ``port`` (pid, command line), where /proc shows it (a process
    of this user); ``(None, "")`` when it cannot be named."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None, ""
    wanted = {f"socket:[{i}]" for i in inodes}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.scandir(f"/proc/{entry.name}/fd")
        except OSError:
            continue
        with fds:
            for fd in fds:
                try:
                    if os.readlink(fd.path) in wanted:
                        pid = int(entry.name)
                        return pid, _cmdline(pid)
                except OSError:
                    continue
    return None, ""


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)[:200]


@dataclass(frozen=True, slots=True)
class Progress:
    """What /proc says of a process group: CPU ticks used (all its processes) and whether
    every one of them is stopped (SIGSTOP, a debugger)."""

    cpu_ticks: int
    stopped: bool


def progress(pgid: int) -> Progress | None:
    """The CPU and run state of process group ``pgid`` (None: gone, or no /proc)."""
    ticks = 0
    states = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for name in entries:
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        # fields[0] is the state (field 3), [2] the pgrp (5), [11]/[12] utime/stime (14, 15)
        if len(fields) < 13 or int(fields[2]) != pgid:
            continue
        states.append(fields[0])
        ticks += int(fields[11]) + int(fields[12])
    if not states:
        return None
    return Progress(ticks, all(s in ("T", "t") for s in states))


def _resolve_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _resolve_prctl()
"""Resolved here, in the parent: the child between fork and exec only calls it (a dlopen
there could block on a loader lock another thread held at the fork)."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The replica is SIGKILLed if the thread that started it (the supervisor's, in the
    node agent) goes away: an agent killed -9 leaves no orphan engine holding its port."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _preexec(nice: int) -> Callable[[], None]:
    def preexec() -> None:  # pragma: no cover - runs in the child between fork and exec
        if nice:
            try:
                os.nice(nice)
            except OSError:
                pass
        _die_with_parent()

    return preexec


def spawn(
    command: Sequence[str], env: Mapping[str, str], log_path: Path, header: str, *, nice: int = 0
) -> subprocess.Popen[bytes]:
    """Start ``command`` in a session of its own (its process group is its PID), output
    appended to ``log_path`` (never through a symlink) after ``header``; OSError when it
    cannot start."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(open_append(log_path), "ab") as log:
        log.write(f"--- trainguard: {header} at {time.ctime()}\n".encode())
        log.flush()
        return subprocess.Popen(
            list(command),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_preexec(nice),
        )


def renice(pid: int, niceness: int) -> bool:
    """Every thread of ``pid`` to ``niceness`` (Linux: a priority is per thread); False when
    the OS refuses (lowering it needs root or RLIMIT_NICE)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    ok = True
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError:
            ok = False
    return ok


def kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except OSError:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def reap(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group (a stopped process too) and reap its leader."""
    kill_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(10.0)
    except subprocess.TimeoutExpired:
        logger.warning("role replica pid %d survives SIGKILL", proc.pid)
