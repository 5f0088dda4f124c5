"""Configuration of trainguard.health (section [health] of trainguard.toml, env TRAINGUARD_HEALTH_*)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class HealthConfig:
    enabled: bool = True
    """Switch the health component on or off."""
