"""Configuration of torchft mode (section [ft] of trainguard.toml, env TRAINGUARD_FT_*)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class FTConfig:
    enabled: bool = False
    """Run this ``trainguard run`` as one torchft replica group (also: ``--ft``)."""
    lighthouse: str = ""
    """URL of a torchft lighthouse (``http://host:port``); empty: find one on 127.0.0.1 at
    ``lighthouse_port`` or start one there (stopped by PID when this launcher exits)."""
    lighthouse_port: int = 29510
    """Port of the lighthouse trainguard finds or starts on 127.0.0.1."""
    replica_group: int = -1
    """This replica group's id; -1: ``REPLICA_GROUP_ID`` from the environment, else 0."""
    min_replicas: int = 1
    """Replica groups a quorum needs (the lighthouse's ``--min_replicas``)."""
    heartbeat_timeout_ms: int = 1000
    """The lighthouse drops a replica group whose manager is silent this long."""
    join_timeout_ms: int = 100
    """How long the lighthouse waits for stragglers before issuing a quorum."""
    quorum_tick_ms: int = 50
    """How often the lighthouse checks for a quorum."""
    timeout_s: float = 10.0
    """torchft Manager timeout for collectives, commits and healing."""
    quorum_timeout_s: float = 60.0
    """torchft Manager timeout waiting for a quorum."""

    def __post_init__(self) -> None:
        # lighthouse (a URL) is checked where it is used, before anything starts
        # (trainguard.ft.lighthouse: one line naming [ft] lighthouse)
        if not 0 < self.lighthouse_port < 65536:
            raise ValueError(f"lighthouse_port = {self.lighthouse_port}: a TCP port (1..65535)")
        if self.replica_group < -1:
            raise ValueError(f"replica_group = {self.replica_group}: >= 0, or -1 (from the env)")
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas = {self.min_replicas}: at least 1")
        for name in ("heartbeat_timeout_ms", "quorum_tick_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} = {getattr(self, name)}: must be > 0")
        if self.join_timeout_ms < 0:
            raise ValueError(f"join_timeout_ms = {self.join_timeout_ms}: must be >= 0")
        for name in ("timeout_s", "quorum_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} = {getattr(self, name)}: must be > 0 seconds")
