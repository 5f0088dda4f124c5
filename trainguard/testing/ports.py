"""Ports for the services and rendezvous endpoints the tests and benchmarks start.

Binding port 0 and closing the socket hands back a port from the kernel's *ephemeral* range,
which any outgoing connection may take before the service binds it. The tests therefore take
ports from below that range (the kernel never hands those out on its own), through one counter
shared by every test process (file lock), so parallel tests never get the same port either.
A port still bound by an earlier service is skipped.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path

__all__ = ["free_port"]

_STATE = Path(tempfile.gettempdir()) / "trainguard-test-ports"


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0")):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def free_port(count: int = 1) -> int:
    """A TCP port outside the ephemeral range that no test took before and nothing holds; with
    ``count``, the first of that many consecutive such ports (a role's replicas bind
    ``port + i``: all of them are taken from the counter, none handed to another test)."""
    low, high = 20000, min(_ephemeral_low(), 32768) - 1
    span = high - low + 1
    with open(_STATE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read().strip()
        n = int(text) if text.isdigit() else (os.getpid() * 7919) % span
        for _ in range(span):
            port = low + n % span
            n += 1
            if port + count - 1 <= high and all(_bindable(port + i) for i in range(count)):
                n += count - 1
                break
        else:  # pragma: no cover - the whole range held
            raise RuntimeError(f"no {count} free port(s) in {low}-{high}")
        f.seek(0)
        f.truncate()
        f.write(str(n % span))
    return port
