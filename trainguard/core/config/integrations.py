"""Configuration of the framework integrations (section [integrations] of trainguard.toml, env
TRAINGUARD_INTEGRATIONS_*).

Example::

    [integrations]
    auto = true     # attach trainguard to transformers' Trainer / Lightning in every worker
    resume = true   # ... with the per-step snapshots and the restore from them
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class IntegrationsConfig:
    auto: bool = True
    """Under ``trainguard run``, attach trainguard's callback to every transformers ``Trainer``
    (TRL's trainers included) and Lightning ``Trainer`` a worker creates, when the script did
    not add it itself: step heartbeats, metrics, preemption. ``false``: only scripts that add
    the callback get them."""
    resume: bool = True
    """The auto-attached callbacks also snapshot every step into trainguard's checkpoint
    manager and restore from it on a restart (``false``: heartbeats, metrics and preemption
    only)."""
