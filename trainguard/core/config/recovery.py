"""Configuration of trainguard.recovery (section [recovery] of trainguard.toml, env TRAINGUARD_RECOVERY_*).

No settings yet: the recovery component adds its own here as it lands.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class RecoveryConfig:
    """The ``[recovery]`` section (empty for now)."""
