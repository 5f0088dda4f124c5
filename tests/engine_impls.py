"""The engine implementations the conformance suite (tests/test_engine_conformance.py) runs
against: one line each. An implementation is a command that serves the engine contract on
``--port`` with the weight store in ``--weights-dir`` (it loads the store's current version
by itself and reports ``serving`` only then), checking every request against the job's token
in ``TRAINGUARD_AGENT_ROLE_TOKEN``."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainguard.core.contracts import envvars
from trainguard.core.contracts.engine import HealthAnswer, probe_health
from trainguard.testing.ports import free_port


def _tiny_gpt2_state() -> dict[str, Any]:
    from trainguard.rl.tiny import tiny_gpt2

    return dict(tiny_gpt2(seed=0).state_dict())


def _tiny_llama_state() -> dict[str, Any]:
    from trainguard.rl.tiny import tiny_llama

    return dict(tiny_llama(seed=0).state_dict())


@dataclass(frozen=True)
class EngineImpl:
    name: str
    command: Callable[[int, Path], list[str]]
    """(port, weight store) → the argv that starts it."""
    startup_s: float = 120.0
    vocab_size: int | None = None
    """The vocabulary the implementation's health must report (None: not checked)."""
    state: Callable[[], dict[str, Any]] = _tiny_gpt2_state
    """The weights of version 0 (the model the implementation serves)."""
    marks: tuple[Any, ...] = ()
    """pytest marks of its parameter (``engines``: only under ``make test-engines``)."""


def _embedded(port: int, weights: Path) -> list[str]:
    return [sys.executable, "-m", "trainguard.rl.engine", "--port", str(port),
            "--weights-dir", str(weights), "--poll-interval-s", "0.2"]  # fmt: skip


def _stub(port: int, weights: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tests.stub_engine",
        "--port",
        str(port),
        "--weights-dir",
        str(weights),
    ]


def _vllm(port: int, weights: Path) -> list[str]:
    from tests.vllm_engine import require_vllm
    from trainguard.rl.engines.launch import adapter_command

    require_vllm()  # a skip with its reason (a failure under make test-engines)
    return adapter_command("--port", str(port), "--weights-dir", str(weights),
                           "--poll-interval-s", "0.2")  # fmt: skip


IMPLS = [
    EngineImpl("embedded", _embedded, vocab_size=17),
    EngineImpl("stub", _stub, startup_s=30.0, vocab_size=17),
    EngineImpl(
        "vllm",
        _vllm,
        startup_s=1200.0,
        vocab_size=512,
        state=_tiny_llama_state,
        marks=(pytest.mark.engines, pytest.mark.timeout(1800)),  # vLLM starts in minutes
    ),
]
"""Every engine the suite checks against the contract (add an adapter here)."""


class RunningEngine:
    """One implementation started as a real process on a free loopback port, with its own
    incarnation nonce (as the role supervisor gives it)."""

    def __init__(self, impl: EngineImpl, weights: Path, log: Path) -> None:
        self.impl = impl
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.incarnation = secrets.token_hex(8)
        self.token = secrets.token_hex(32)
        """The job's rollout token, as the role supervisor gives it (every request signed)."""
        env = {
            **os.environ,
            envvars.ROLE_INCARNATION: self.incarnation,
            envvars.ROLE_TOKEN: self.token,
            "OMP_NUM_THREADS": "1",
        }
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            impl.command(self.port, weights), env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_health(self, until: Callable[[HealthAnswer], bool], timeout: float) -> HealthAnswer:
        deadline = time.monotonic() + timeout
        while True:
            p = probe_health(self.port, timeout=2.0, token=self.token)
            if p.health is not None and until(p.health):
                return p.health
            rc = self.proc.poll()
            assert rc is None, f"{self.impl.name} engine exited with {rc}; see its log"
            assert time.monotonic() < deadline, f"{self.impl.name}: {p}"
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()
