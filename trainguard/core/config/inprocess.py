"""Configuration of in-process restarts (section [inprocess] of trainguard.toml, env
TRAINGUARD_INPROCESS_*).

Example::

    [inprocess]
    enabled = true          # restart survivors in their process when the script asks for it
    join_timeout_s = 120.0  # survivors wait this long for the next generation's process group
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class InProcessConfig:
    enabled: bool = True
    """Let workers whose training runs in ``trainguard.run(fn)`` restart in their process when
    a local worker dies (only the dead one is replaced). Scripts that do not use
    ``trainguard.run`` are restarted as torchrun would, whatever this says."""
    detect_timeout_s: float = 10.0
    """A survivor whose collective failed because a peer died waits this long for the agent to
    announce the next generation; without one it exits and the agent restarts the group."""
    join_timeout_s: float = 120.0
    """Timeout of the next generation's ``init_process_group`` (the replacement's start-up,
    ``import torch`` included, must fit)."""

    def __post_init__(self) -> None:
        for name in ("detect_timeout_s", "join_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
