"""Configuration of trainguard.recovery (section [recovery] of trainguard.toml, env TRAINGUARD_RECOVERY_*)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class RecoveryConfig:
    enabled: bool = True
    """Switch the recovery component on or off."""
