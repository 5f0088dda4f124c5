"""Engine replicas as local processes, started the way ``trainguard run``'s ``rollout`` role
starts them (same command, same environment contract), for the tests that drive the fleet
themselves: kill one, restart it on its port, wait for it to serve.

Each replica gets ``TRAINGUARD_ROLE=rollout``, ``TRAINGUARD_ROLE_REPLICA=<i>``,
``TRAINGUARD_ROLE_PORT=<port>`` (kept across restarts), ``TRAINGUARD_ROLE_INCARNATION``,
``TRAINGUARD_RUN_DIR`` and ``TRAINGUARD_ROLE_TOKEN``, its role's token from the run directory's
fleet secret (created there as ``trainguard run``'s agent does: pass :attr:`LocalEngines.token`
to the clients); a warm standby the role's standby contract (``TRAINGUARD_ROLE_STANDBY``: a port
of its own, then the promotion file), as the role supervisor gives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from trainguard.core.atomicfile import open_append, write_atomic
from trainguard.core.contracts import envvars
from trainguard.core.contracts.engine import HEALTH_PATH, ReplicaStatus, probe_health
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.fleetauth import job_secret, role_token
from trainguard.roles.procs import free_port, new_incarnation

__all__ = ["LocalEngines", "engine_health"]


def engine_health(
    port: int, timeout: float = 2.0, *, token: str | None = None
) -> dict[str, Any] | None:
    """The health answer of the engine on ``127.0.0.1:port`` (parsed by the contract's one
    probe, as a dict; the request signed with the job's ``token``, the answer checked); None
    when it does not answer well."""
    p = probe_health(port, HEALTH_PATH, timeout, token=token)
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
        """``standby``: keep a warm standby per replica, promoted by :meth:`restart` (it takes
        the port as soon as the old replica is gone).
        ``role``/``module``: another fleet, e.g. ``reward`` servers (``trainguard.rl.reward``)."""
        self.role = role
        self.module = module
        self.token = role_token(job_secret(run_dir), role)
        """The token of this fleet's role (what its clients must sign with)."""
        self.ports = list(ports)
        self.run_dir = Path(run_dir)
        self.args = list(args)
        self.env = env or {}
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(self.ports)
        self.restarts = [0] * len(self.ports)
        self._logs: list[IO[bytes] | None] = [None] * len(self.ports)
        self.standby = standby
        self.spares: list[subprocess.Popen[bytes] | None] = [None] * len(self.ports)
        self._orders: list[Path | None] = [None] * len(self.ports)
        """Each spare's promotion file."""
        self._starts = 0

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def _spawn(self, k: int, standby: bool = False) -> subprocess.Popen[bytes]:
        self._starts += 1
        env = {
            **os.environ,
            **self.env,
            envvars.ROLE: self.role,
            envvars.ROLE_REPLICA: str(k),
            envvars.ROLE_PORT: str(self.ports[k]),
            envvars.ROLE_RUN_DIR: str(self.run_dir),
            envvars.ROLE_INCARNATION: new_incarnation(),
            envvars.ROLE_TOKEN: self.token,
            "OMP_NUM_THREADS": "1",
        }
        if standby:
            order = RunDir(self.run_dir).role_standby(self.role, k, f"{self._starts}.promote")
            self._orders[k] = order
            env[envvars.ROLE_PORT] = str(free_port())
            env[envvars.ROLE_STANDBY] = str(order)
            del env[envvars.ROLE_REPLICA]
        log = RunDir(self.run_dir).role_log(self.role, k)
        log.parent.mkdir(parents=True, exist_ok=True)
        if self._logs[k] is None:  # closed in close(); appended, no symlink followed
            self._logs[k] = os.fdopen(open_append(log), "ab")
        return subprocess.Popen(
            [sys.executable, "-m", self.module, *self.args],
            env=env,
            stdout=self._logs[k],
            stderr=subprocess.STDOUT,
        )

    def start(self, i: int | None = None) -> None:
        for k in range(len(self.ports)) if i is None else [i]:
            self.procs[k] = self._spawn(k)
            if self.standby and self.spares[k] is None:
                self.spares[k] = self._spawn(k, standby=True)

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
        spare, order = self.spares[i], self._orders[i]
        if spare is not None and spare.poll() is None and order is not None:
            body = {"replica": i, "port": self.ports[i], "role": self.role, "port_wait_s": 30}
            write_atomic(order, json.dumps(body) + "\n")
            self.procs[i] = spare
            self.spares[i] = self._spawn(i, standby=True)
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
                h = engine_health(self.ports[k], token=self.token)
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
