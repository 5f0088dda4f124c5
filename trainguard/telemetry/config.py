"""Configuration of trainguard.telemetry (section [telemetry] of trainguard.toml, env TRAINGUARD_TELEMETRY_*)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class TelemetryConfig:
    enabled: bool = True
    """Switch the telemetry component on or off."""
