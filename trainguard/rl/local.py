"""Engine replicas as local processes, started the way ``trainguard run``'s ``rollout`` role
starts them (same command, same environment contract), for tests and benchmarks that drive
the fleet themselves: kill one, restart it on its port, wait for it to serve.

Each replica gets ``TRAINGUARD_ROLE=rollout``, ``TRAINGUARD_ROLE_REPLICA=<i>``,
``TRAINGUARD_ROLE_PORT=<port>`` (kept across restarts) and ``TRAINGUARD_RUN_DIR``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from trainguard.core.atomicfile import open_append
from trainguard.core.engine_contract import HEALTH_PATH, ReplicaStatus, probe_health

__all__ = ["LocalEngines", "engine_health"]


def engine_health(port: int, timeout: float = 2.0) -> dict[str, Any] | None:
    """The health answer of the engine on ``127.0.0.1:port`` (parsed by the contract's one
    probe, as a dict); None when it does not answer well."""
    p = probe_health(port, HEALTH_PATH, timeout)
    return p.health.to_json() if p.health is not None else None


class LocalEngines:
    def __init__(
        self,
        ports: Sequence[int],
        *,
        run_dir: str | os.PathLike[str],
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        standby: bool = False,
        role: str = "rollout",
        module: str = "trainguard.rl.engine",
    ) -> None:
        """``standby``: keep a warm replacement per replica (``--standby``), promoted by
        :meth:`restart` (the new primary takes the port as soon as the old one is gone).
        ``role``/``module``: another fleet, e.g. ``reward`` servers (``trainguard.rl.reward``)."""
        self.role = role
        self.module = module
        self.ports = list(ports)
        self.run_dir = Path(run_dir)
        self.args = list(args)
        self.env = env or {}
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(self.ports)
        self.restarts = [0] * len(self.ports)
        self._logs: list[IO[bytes] | None] = [None] * len(self.ports)
        self.standby = standby
        self.spares: list[subprocess.Popen[bytes] | None] = [None] * len(self.ports)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def _spawn(self, k: int, extra: list[str]) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            **self.env,
            "TRAINGUARD_ROLE": self.role,
            "TRAINGUARD_ROLE_REPLICA": str(k),
            "TRAINGUARD_ROLE_PORT": str(self.ports[k]),
            "TRAINGUARD_RUN_DIR": str(self.run_dir),
            "OMP_NUM_THREADS": "1",
        }
        logs = self.run_dir / "roles"
        logs.mkdir(parents=True, exist_ok=True)
        if self._logs[k] is None:  # closed in close(); appended, no symlink followed
            self._logs[k] = os.fdopen(open_append(logs / f"{self.role}_{k}.log"), "ab")
        return subprocess.Popen(
            [sys.executable, "-m", self.module, *self.args, *extra],
            env=env,
            stdout=self._logs[k],
            stderr=subprocess.STDOUT,
        )

    def start(self, i: int | None = None) -> None:
        for k in range(len(self.ports)) if i is None else [i]:
            self.procs[k] = self._spawn(k, [])
            if self.standby and self.spares[k] is None:
                self.spares[k] = self._spawn(k, ["--standby"])

    def pid(self, i: int) -> int:
        p = self.procs[i]
        assert p is not None
        return p.pid

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            os.kill(p.pid, sig)
            if sig == signal.SIGKILL:
                p.wait()

    def restart(self, i: int) -> None:
        """Kill replica ``i`` (if alive) and replace it: its warm standby takes over when there
        is one (and a new standby starts), else a fresh process."""
        self.kill(i)
        p = self.procs[i]
        if p is not None:
            p.wait()
        self.restarts[i] += 1
        spare = self.spares[i]
        if spare is not None and spare.poll() is None:
            self.procs[i] = spare
            self.spares[i] = self._spawn(i, ["--standby"])
        else:
            self.spares[i] = None
            self.start(i)

    def wait_serving(
        self, i: int | None = None, *, version: int | None = None, timeout: float = 120.0
    ) -> None:
        """Until replica ``i`` (default: all) reports ``serving`` (with ``version``)."""
        deadline = time.monotonic() + timeout
        for k in range(len(self.ports)) if i is None else [i]:
            while True:
                h = engine_health(self.ports[k])
                if h and h.get("status") == ReplicaStatus.SERVING:
                    if version is None or h.get("weight_version") == version:
                        break
                p = self.procs[k]
                if p is not None and p.poll() is not None:
                    raise RuntimeError(
                        f"engine {k} exited with {p.returncode}; see {self.run_dir}/roles"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine {k} not serving after {timeout:.0f} s: {h}")
                time.sleep(0.1)

    def close(self) -> None:
        for k, p in enumerate(self.procs):
            for proc in (p, self.spares[k]):
                if proc is not None and proc.poll() is None:
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped process must be able to die
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
            log = self._logs[k]
            if log is not None:
                log.close()
