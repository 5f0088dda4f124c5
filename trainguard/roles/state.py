"""What the role supervisor knows of its replicas and standbys (written to their state files,
``roles/<role>/<i>.json`` and ``roles/<role>/standby-<k>.json``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from trainguard.core.config.roles import RoleSpec
from trainguard.core.contracts.engine import ReplicaStatus as S

__all__ = ["ReplicaState", "StandbyState"]


class ReplicaState:
    """What the supervisor knows of one replica (written to its state file)."""

    def __init__(
        self, spec: RoleSpec, index: int, port: int, node: str = "", host: str = "127.0.0.1"
    ) -> None:
        self.node = node
        self.role = spec.name
        self.index = index
        self.port = port
        self.url = spec.url(port, host)
        self.state = S.STARTING
        self.pid: int | None = None
        self.incarnation: str | None = None
        """The nonce of the running start (its health answers name it)."""
        self.restarts = 0
        self.weight_version: int | None = None
        self.ever_ready = False
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.changed_at = time.time()
        self.last_ok: float | None = None
        self.exitcode: int | None = None
        self.reason = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "replica": self.index,
            "node": self.node,
            "pid": self.pid,
            "incarnation": self.incarnation,
            "port": self.port,
            "url": self.url,
            "state": self.state,
            "restarts": self.restarts,
            "weight_version": self.weight_version,
            "started_at": self.started_at,
            "ready_at": self.ready_at,
            "changed_at": self.changed_at,
            "last_ok": self.last_ok,
            "exitcode": self.exitcode,
            "reason": self.reason,
        }


class StandbyState:
    """One warm standby slot of a role (written to ``roles/<role>/standby-<k>.json``)."""

    def __init__(self, spec: RoleSpec, slot: int) -> None:
        self.role = spec.name
        self.slot = slot
        self.port = 0
        """Its own port, a fresh one for each start (never routed to): a promoted standby that
        still answers on its old port is never taken for its successor."""
        self.state = S.STARTING
        self.pid: int | None = None
        self.incarnation: str | None = None
        self.starts = 0
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.changed_at = time.time()
        self.reason = ""
        self.promoted = False
        """Set (under the supervisor's lock) when a replica took this incarnation."""
        self.handed = threading.Event()
        """Set once the replica that took it has done its bookkeeping (then a new one starts)."""
        self.promote_path: Path | None = None
        """This incarnation's promotion file (one per incarnation: a promoted process may read
        it after the next standby started)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "slot": self.slot,
            "pid": self.pid,
            "incarnation": self.incarnation,
            "port": self.port,
            "state": self.state,
            "starts": self.starts,
            "started_at": self.started_at,
            "ready_at": self.ready_at,
            "changed_at": self.changed_at,
            "reason": self.reason,
        }
