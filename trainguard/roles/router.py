"""The fleet endpoint's process, as the roles plugin runs it beside the trainer
(``[roles] router = true``).

The endpoint (``python -m trainguard.rl.router``) is a process of its own, not a thread of
the agent: the agent's monitoring loop stays free of the proxied generation traffic, the
features stay apart (the endpoint is the rollout client's routing, :mod:`trainguard.rl`,
which the roles do not import), and an endpoint that crashes is restarted without touching
the agent or the trainer. It keeps one port for the whole job (its URL is in the workers' and
the replicas' environment), is started once before the first rendezvous, restarted (after a
short back-off) when it exits, and stopped by PID with the agent. Its output goes to
``RUN_DIR/roles/router.log``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainguard.core.atomicfile import make_dirs, open_append
from trainguard.core.config.roles import RolesConfig
from trainguard.core.contracts import envvars
from trainguard.core.contracts.rundir import RunDir

__all__ = ["RouterProcess", "check_router_port"]

logger = logging.getLogger(__name__)

_RESTART_BACKOFF_S = 1.0


def check_router_port(cfg: RolesConfig) -> str | None:
    """Why the fleet endpoint's fixed port cannot be bound (one line), or None."""
    if not cfg.router or not cfg.router_port:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((cfg.router_bind, cfg.router_port))
        except OSError as e:
            return (
                f"[roles] router_port {cfg.router_port} on {cfg.router_bind}: {e.strerror}; "
                "choose a free port, or router_port = 0 for any free one"
            )
    return None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _resolve_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _resolve_prctl()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: no orphan holding the port


class RouterProcess:
    """The endpoint's process: its port and URL chosen at construction, started by
    :meth:`start`, kept running by :meth:`check`, ended by :meth:`stop`."""

    def __init__(self, cfg: RolesConfig, run_dir: Path, fleet_token: str, node: str = "") -> None:
        self.host = cfg.router_bind
        self.port = cfg.router_port or _free_port(self.host)
        url_host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        self.url = f"http://{url_host}:{self.port}"
        self.run_dir = run_dir
        self.fleet_token = fleet_token
        self.node = node
        self.health_interval_s = min(cfg.probe_interval_s, 0.5)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._next_start = 0.0
        self._env: dict[str, str] = {}

    def env(self) -> dict[str, str]:
        """``TRAINGUARD_FLEET_URL`` and ``TRAINGUARD_FLEET_TOKEN``: for the trainer's workers
        and the role replicas."""
        return {envvars.FLEET_URL: self.url, envvars.FLEET_TOKEN: self.fleet_token}

    def start(self, engines: Mapping[str, str]) -> None:
        """Start it (once): ``engines`` holds the rollout URLs and token the trainer's workers
        get (``TRAINGUARD_ROLLOUT_URLS``, ``TRAINGUARD_ROLLOUT_TOKEN``)."""
        if self.proc is not None:
            return
        env = {k: v for k, v in os.environ.items() if not k.startswith(envvars.PREFIX)}
        env.update(engines)
        env[envvars.FLEET_TOKEN] = self.fleet_token
        env[envvars.ROLE_RUN_DIR] = str(self.run_dir)
        self._env = env
        self._spawn()

    def _spawn(self) -> None:
        log_path = RunDir(self.run_dir).router_log
        make_dirs(log_path.parent)
        cmd = [
            sys.executable, "-m", "trainguard.rl.router", "--host", self.host,
            "--port", str(self.port), "--health-interval-s", str(self.health_interval_s),
            "--node", self.node,
        ]  # fmt: skip
        with os.fdopen(open_append(log_path), "ab") as log:  # never through a symlink
            self.proc = subprocess.Popen(
                cmd,
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.starts += 1
        logger.info("fleet endpoint %s started (pid %d)", self.url, self.proc.pid)

    def check(self) -> None:
        """Restart the endpoint if it exited (after a short back-off)."""
        proc = self.proc
        if proc is None or proc.poll() is None:
            return
        now = time.monotonic()
        if self._next_start == 0.0:
            logger.warning(
                "fleet endpoint %s exited with %s; restarting it (%s)",
                self.url,
                proc.returncode,
                RunDir(self.run_dir).router_log,
            )
            self._next_start = now + _RESTART_BACKOFF_S
        if now >= self._next_start:
            self._next_start = 0.0
            self._spawn()

    def stop(self, timeout: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
