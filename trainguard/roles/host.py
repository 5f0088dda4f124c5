"""What a replica's loop and a standby pool need of the supervisor that runs them (the
supervisor is the one implementation; the protocol keeps the modules free of import cycles)."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Mapping
from typing import Protocol

from trainguard.core.config.roles import RolesConfig, RoleSpec
from trainguard.core.contracts.engine import ReplicaStatus as S
from trainguard.core.contracts.rundir import RunDir
from trainguard.roles.health import Probe
from trainguard.roles.state import ReplicaState, StandbyState

__all__ = ["Standbys", "SupervisorHost"]


class Standbys(Protocol):
    """A role's standby pool as a replica sees it."""

    def take(self, rep: ReplicaState) -> tuple[subprocess.Popen[bytes], StandbyState] | None: ...

    def handed(self, sb: StandbyState) -> None: ...


class SupervisorHost(Protocol):
    cfg: RolesConfig
    rundir: RunDir
    lock: threading.Lock
    """Guards ``procs``, the pools' ready lists and the role's counters."""
    stopping: threading.Event
    """Set when the job ends."""
    ended: threading.Event
    """Set once every process is ended."""
    bind_host: dict[str, str]
    procs: dict[tuple[str, str], subprocess.Popen[bytes]]
    niceness: int
    startup_s: dict[str, float]

    @property
    def pools(self) -> Mapping[str, Standbys]: ...

    def role_env(
        self, spec: RoleSpec, port: int, incarnation: str, *, replica: int | None = None
    ) -> dict[str, str]: ...

    def probe(self, spec: RoleSpec, port: int) -> Probe: ...

    def answered(
        self, spec: RoleSpec, rep: ReplicaState, status: S, version: int | None
    ) -> str | None: ...

    def standby_port(self, spec: RoleSpec) -> int: ...

    def note_startup(self, spec: RoleSpec, seconds: float) -> None: ...

    def replica_started(
        self, spec: RoleSpec, rep: ReplicaState, pid: int, incarnation: str, standby: int | None
    ) -> None: ...

    def port_taken(
        self, spec: RoleSpec, rep: ReplicaState, pid: int | None, holder: str, waited_s: float
    ) -> None: ...

    def replica_failed(
        self, spec: RoleSpec, rep: ReplicaState, reason: str, was_ready: bool
    ) -> None: ...

    def allow_restart(
        self, spec: RoleSpec, rep: ReplicaState, reason: str, was_ready: bool
    ) -> bool: ...

    def retire(self, spec: RoleSpec, rep: ReplicaState, reason: str) -> None: ...

    def fail(
        self,
        spec: RoleSpec,
        rep: ReplicaState,
        message: str,
        budget: bool = False,
        keep_state: bool = False,
    ) -> None: ...

    def set_state(
        self,
        rep: ReplicaState,
        state: S,
        *,
        reason: str = "",
        weight_version: int | None = None,
        force: bool = False,
    ) -> None: ...

    def set_standby(
        self, sb: StandbyState, state: S, *, reason: str = "", force: bool = False
    ) -> None: ...
