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
