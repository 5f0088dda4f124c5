"""Loopback ports for the servers the tests and benchmarks start."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["free_port", "wait_listening", "wait_until"]

T = TypeVar("T")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick)."""
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


def wait_until(fn: Callable[[], T | None], timeout: float, what: str, interval: float = 0.2) -> T:
    """``fn()``'s first true value (an exception counts as none yet); TimeoutError naming
    ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            v = fn()
        except Exception:
            v = None
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
