"""The rollout client's public types: its settings, what it returns and how it fails (shared by
the client's parts: the engine table, batch dispatch and weight sync)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from trainguard.core.contracts import envvars
from trainguard.core.contracts.engine import ReplicaStatus
from trainguard.core.contracts.metrics import ROLLOUT_FAILURE_REASONS

__all__ = [
    "FAILURE_REASONS",
    "Completion",
    "EngineState",
    "RolloutConfig",
    "RolloutError",
    "SyncResult",
    "urls_from_env",
]

ROLLOUT_URLS_ENV = envvars.ROLLOUT_URLS
REWARD_URLS_ENV = envvars.REWARD_URLS

FAILURE_REASONS = ROLLOUT_FAILURE_REASONS
"""Why a rollout request failed (see :data:`trainguard.core.contracts.metrics.ROLLOUT_FAILURE_REASONS`)."""

EngineState = ReplicaStatus
"""An engine's state as the client sees it: the contract's one vocabulary
(:data:`trainguard.core.contracts.engine.CLIENT_STATES` are the ones the client uses)."""


class RolloutError(RuntimeError):
    """A batch could not be completed with real generations within its caps."""


def urls_from_env(name: str = ROLLOUT_URLS_ENV) -> list[str]:
    raw = os.environ.get(name, "")
    return [u.strip().rstrip("/") for u in raw.split(",") if u.strip()]


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    max_staleness: int = 0
    """Versions of lag a sample may have: 0 = on-policy, k = async with k versions of lag."""
    request_timeout_s: float = 60.0
    """No answer from an engine in this time: the request fails (``timeout``) and is retried."""
    max_attempts: int = 4
    """Attempts per request (the first one included) before the batch fails."""
    batch_timeout_s: float = 600.0
    """A batch not complete in this time raises :class:`RolloutError`."""
    prompts_per_request: int = 4
    """Prompts of a batch sent in one request (each with its ``n`` completions)."""
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    dead_after_failures: int = 2
    """Consecutive failed probes (timeouts, errors) that declare an engine dead."""
    failure_cooldown_s: float = 2.0
    """An engine whose request failed gets no request for this long, doubled for each further
    failure in a row (up to ``failure_cooldown_max_s``; an answer resets it): the retries of a
    batch are spread over the time a faulty engine needs to recover or be replaced, rather
    than spent on it within seconds."""
    failure_cooldown_max_s: float = 16.0
    sync_timeout_initial_s: float = 60.0
    """Weight-sync timeout before any sync was measured."""
    sync_timeout_factor: float = 5.0
    sync_timeout_min_s: float = 3.0
    """Sync timeout = max(min, factor × median of the measured sync times)."""
    refit_attempts: int = 3
    """Refits of an engine whose refit failed its check (quarantined) within one sync."""
    drop_failed_groups: bool = False
    """A request out of attempts leaves its prompts without completions (empty groups, for
    the caller to drop whole: :func:`trainguard.rl.groups.settle`) instead of failing the
    batch; an invalid request (HTTP 4xx) or a refused signature still raises."""
    vocab_size: int | None = None
    """The policy's vocabulary size: a token id outside ``0..vocab_size-1`` makes an answer
    malformed (None: the engine's reported ``vocab_size``, else any id below 2**31)."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness}: give 0 (on-policy) or more")
        if self.max_attempts < 1 or self.prompts_per_request < 1:
            raise ValueError("max_attempts and prompts_per_request must be at least 1")
        if min(self.request_timeout_s, self.health_interval_s, self.health_timeout_s) <= 0:
            raise ValueError("timeouts and intervals must be positive")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size={self.vocab_size}: give the policy's vocabulary size")


@dataclass(frozen=True, slots=True)
class Completion:
    """One real generation."""

    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    weight_version: int
    staleness: int
    """The trainer's policy version when the answer arrived − the version that generated it
    (within ``0..max_staleness``)."""
    engine: str


@dataclass(frozen=True, slots=True)
class SyncResult:
    version: int
    duration_s: float
    timeout_s: float
    confirmed: list[str]
    missed: list[str]
