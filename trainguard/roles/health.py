"""Health probes of role replicas, and whose answer a probe got.

A replica's health answer names the process that gave it: ``pid`` (its own) and
``incarnation`` (the nonce the supervisor gave that start in ``TRAINGUARD_ROLE_INCARNATION``).
An answer counts only when it comes from the process the supervisor started: another
process on the port (a squatter, or a promoted standby still on its old port) is never taken
for the replica.
"""

from __future__ import annotations

import enum
import http.client
import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["Probe", "Whose", "health_answer", "probe_health", "whose"]


@dataclass(frozen=True, slots=True)
class Probe:
    """One health probe's outcome."""

    outcome: str
    """``ok``, ``refused``, ``timeout``, ``http_error``, ``malformed``, ``error``."""
    status: str | None = None
    weight_version: int | None = None
    detail: str = ""
    pid: int | None = None
    """The pid the answer names (None: it names none)."""
    incarnation: str | None = None
    """The incarnation nonce the answer names (None: it names none)."""

    def identity(self) -> str:
        """How the answer names its process, for events and messages."""
        return f"pid {self.pid}, incarnation {self.incarnation}"


def health_answer(
    port: int, path: str = "/health", timeout: float = 2.0, host: str = "127.0.0.1"
) -> dict[str, Any] | None:
    """The whole JSON object a replica's health answers (e.g. an engine's ``inflight``);
    None when it does not answer one."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        data = json.loads(resp.read(65536))
        return data if resp.status == 200 and isinstance(data, dict) else None
    except (OSError, ValueError, RecursionError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def probe_health(port: int, path: str, timeout: float, host: str = "127.0.0.1") -> Probe:
    """``GET http://<host>:<port><path>``; never raises."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read(65536)
    except ConnectionRefusedError:
        return Probe("refused", detail="connection refused")
    except TimeoutError:
        return Probe("timeout", detail=f"no answer in {timeout:g} s")
    except (OSError, http.client.HTTPException) as e:
        return Probe("error", detail=f"{type(e).__name__}: {e}")
    finally:
        conn.close()
    if resp.status != 200:
        return Probe("http_error", detail=f"HTTP {resp.status}")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return Probe("malformed", detail="health answer is not JSON")
    if not isinstance(data, dict) or not isinstance(data.get("status"), str):
        return Probe("malformed", detail='health answer has no "status"')
    version = data.get("weight_version")
    if isinstance(version, bool) or not isinstance(version, int):
        version = None
    pid = data.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        pid = None
    inc = data.get("incarnation")
    inc = inc[:64] if isinstance(inc, str) and inc else None
    return Probe("ok", status=data["status"][:64], weight_version=version, pid=pid, incarnation=inc)


class Whose(enum.Enum):
    """Whose answer a probe got, as the supervisor sees it."""

    OWN = "own"
    """The process it started (its incarnation; or, where the answer names no incarnation,
    a pid of that process's group)."""
    FOREIGN = "foreign"
    """Another process."""
    ANONYMOUS = "anonymous"
    """The answer names no process: never counted."""


def whose(p: Probe, pgid: int, incarnation: str) -> Whose:
    if p.incarnation is not None:
        return Whose.OWN if p.incarnation == incarnation else Whose.FOREIGN
    if p.pid is not None:
        if p.pid == pgid:
            return Whose.OWN
        try:
            return Whose.OWN if os.getpgid(p.pid) == pgid else Whose.FOREIGN
        except OSError:  # not here (another host's pid) or gone
            return Whose.FOREIGN
    return Whose.ANONYMOUS
