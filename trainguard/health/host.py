"""Source: host checks (free disk on the checkpoint directory, free memory, rendezvous
endpoint reachability). Always present; on a CPU-only node it is the only source."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

from trainguard.core.config.health import HealthConfig
from trainguard.health.policy import Policy
from trainguard.health.result import ProbeResult

__all__ = ["HostSource", "available_memory_bytes"]

NAME = "host"
GIB = 1 << 30


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None elsewhere."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def parse_endpoint(endpoint: str | None) -> tuple[str, int] | None:
    """``host:port`` → (host, port); None when there is nothing to reach (no port, port 0)."""
    if not endpoint:
        return None
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or int(port) == 0:
        return None
    return host.strip("[]") or "localhost", int(port)


class HostSource:
    name = NAME

    def __init__(
        self,
        cfg: HealthConfig,
        policy: Policy,
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        rdzv_endpoint: str | None = None,
        connect_timeout_s: float = 2.0,
    ) -> None:
        self.cfg = cfg
        self.policy = policy
        self.checkpoint_dir = Path(checkpoint_dir or cfg.checkpoint_dir or ".")
        self.rdzv_endpoint = rdzv_endpoint
        self.connect_timeout_s = connect_timeout_s

    def probe(self) -> ProbeResult:
        t0 = time.monotonic()
        result = ProbeResult(source=NAME)
        result.details["hostname"] = socket.gethostname()
        self._disk(result)
        self._memory(result)
        self._rdzv(result)
        result.duration_s = time.monotonic() - t0
        return result

    def _disk(self, result: ProbeResult) -> None:
        where = _existing_parent(self.checkpoint_dir)
        try:
            free = shutil.disk_usage(where).free
        except OSError as e:
            result.details["disk_error"] = str(e)
            return
        result.details["checkpoint_dir"] = str(self.checkpoint_dir)
        result.details["disk_free_gib"] = round(free / GIB, 2)
        if free < self.cfg.min_free_disk_gib * GIB:
            result.add(
                self.policy.finding(
                    "host_disk_low",
                    f"{free / GIB:.1f} GiB free on {where} (checkpoints need "
                    f"{self.cfg.min_free_disk_gib:g} GiB)",
                )
            )

    def _memory(self, result: ProbeResult) -> None:
        avail = available_memory_bytes()
        if avail is None:
            return
        result.details["memory_available_gib"] = round(avail / GIB, 2)
        if avail < self.cfg.min_free_memory_gib * GIB:
            result.add(
                self.policy.finding(
                    "host_memory_low",
                    f"{avail / GIB:.1f} GiB host memory available "
                    f"(need {self.cfg.min_free_memory_gib:g} GiB)",
                )
            )

    def _rdzv(self, result: ProbeResult) -> None:
        target = parse_endpoint(self.rdzv_endpoint)
        if target is None:
            return
        t0 = time.monotonic()
        try:
            with socket.create_connection(target, timeout=self.connect_timeout_s):
                pass
        except OSError as e:
            result.details["rdzv_reachable"] = False
            result.add(
                self.policy.finding(
                    "rdzv_unreachable", f"rendezvous endpoint {self.rdzv_endpoint} unreachable: {e}"
                )
            )
            return
        result.details["rdzv_reachable"] = True
        result.details["rdzv_connect_ms"] = round((time.monotonic() - t0) * 1e3, 2)
