"""Configuration of trainguard.checkpoint (section [checkpoint] of trainguard.toml, env TRAINGUARD_CHECKPOINT_*)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    enabled: bool = True
    """Switch the checkpoint component on or off."""
