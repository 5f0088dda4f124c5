"""Group integrity for group-relative RL (GRPO): a group (one prompt × ``n`` samples) is trained
complete or dropped whole, never padded; by setting (``shrink``), a group that lost members is
shrunk to its survivors when at least ``min_survivors`` are left, its advantages computed over
them alone.

A member does not survive when it is missing (the group's request failed after its attempts:
``RolloutConfig.drop_failed_groups``), when it is not a real generation (no engine), when it
is another member again (the same sample object twice is padding; two samples that happen to
read the same are two samples), or when, at the version it is
trained into, it is staler than the bound ``k`` (``train_version - weight_version > k``: an
async sample accepted at ``k`` versions of lag is one version staler one step later).

:func:`settle` judges the groups of one step before training; :class:`SampleRecord` then
records what was trained, sample by sample (``rollout_samples_trained`` events: each sample's
staleness, each group's size, the dropped groups by reason), from which the report draws the
staleness histogram and counts the dropped groups.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trainguard.core.contracts.event_kinds import ROLLOUT_SAMPLES_TRAINED
from trainguard.rl.rollout_types import Completion

__all__ = [
    "DROP_REASONS",
    "GROUP_POLICIES",
    "Settled",
    "SampleRecord",
    "advantages",
    "settle",
]

GROUP_POLICIES = ("whole", "shrink")
"""``whole``: a group is trained complete or dropped; ``shrink``: its survivors are trained
when there are at least ``min_survivors`` of them."""

DROP_REASONS = ("failed", "not_generated", "duplicate", "stale", "too_few")
"""Why a member did not survive (``too_few``: a shrunk group with fewer survivors than the
minimum); a dropped group is counted under its first member's reason."""


@dataclass(slots=True)
class Settled:
    """One step's groups after :func:`settle`: the kept groups (their index in the step's
    list and their members), the dropped ones by reason, and how many were shrunk."""

    kept: list[tuple[int, list[Completion]]] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)
    shrunk: int = 0

    @property
    def samples(self) -> list[Completion]:
        return [c for _, group in self.kept for c in group]


def _why_not(c: Completion, seen: set[int], train_version: int, k: int) -> str | None:
    if not c.engine:
        return "not_generated"
    if id(c) in seen:  # the same sample twice (two samples may well read the same)
        return "duplicate"
    seen.add(id(c))
    if not 0 <= train_version - c.weight_version <= k:
        return "stale"
    return None


def settle(
    groups: Sequence[Sequence[Completion]],
    *,
    n: int,
    train_version: int,
    max_staleness: int,
    policy: str = "whole",
    min_survivors: int = 2,
) -> Settled:
    """Judge each group of one step (each meant to hold ``n`` members) against the version
    it is trained into (``train_version``) and the bound ``max_staleness``."""
    if policy not in GROUP_POLICIES:
        raise ValueError(f"group policy {policy!r}: give one of {', '.join(GROUP_POLICIES)}")
    if min_survivors < 2:
        raise ValueError(f"min_survivors={min_survivors}: a group needs at least 2 to compare")
    out = Settled()
    for gi, group in enumerate(groups):
        seen: set[int] = set()
        why = [_why_not(c, seen, train_version, max_staleness) for c in group]
        lost = ["failed"] * max(0, n - len(group)) + [w for w in why if w is not None]
        survivors = [c for c, w in zip(group, why, strict=True) if w is None][:n]
        if not lost and len(survivors) == n:
            out.kept.append((gi, survivors))
        elif policy == "shrink" and len(survivors) >= min_survivors:
            out.kept.append((gi, survivors))
            out.shrunk += 1
        else:
            out.dropped[lost[0] if lost else "too_few"] += 1
    return out


def advantages(rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    """Group-relative advantages of one group's rewards: ``(r - mean) / (std + eps)`` with
    the sample standard deviation (as ``torch.std``), over the members trained."""
    m = len(rewards)
    if m < 2:
        raise ValueError(f"a group of {m}: advantages need at least 2 members")
    mean = sum(rewards) / m
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (m - 1))
    return [(r - mean) / (std + eps) for r in rewards]


class SampleRecord:
    """Records what one rank trained at each step: a ``rollout_samples_trained`` event with
    each sample's staleness (``train_version - weight_version``), each kept group's size,
    the dropped groups by reason and the shrunk ones."""

    def __init__(self, emit: Callable[..., object], rank: int = 0, *, bound: int = 0) -> None:
        self._emit = emit
        self.rank = rank
        self.bound = bound
        self.dropped: Counter[str] = Counter()
        self.shrunk = 0

    def trained(self, step: int, train_version: int, settled: Settled) -> dict[str, float]:
        """Emit the step's record; the step's figures for the trainer's log."""
        stale = [train_version - c.weight_version for c in settled.samples]
        self.dropped.update(settled.dropped)
        self.shrunk += settled.shrunk
        self._emit(
            ROLLOUT_SAMPLES_TRAINED,
            step=step,
            rank=self.rank,
            version=train_version,
            bound=self.bound,
            staleness=stale,
            group_sizes=[len(g) for _, g in settled.kept],
            dropped=dict(settled.dropped),
            shrunk=settled.shrunk,
        )
        out: dict[str, float] = {
            "groups_trained": len(settled.kept),
            "groups_shrunk": settled.shrunk,
            "groups_dropped": sum(settled.dropped.values()),
        }
        for reason, count in settled.dropped.items():
            out[f"groups_dropped_{reason}"] = count
        if stale:
            out["staleness_max"] = max(stale)
            out["staleness_mean"] = sum(stale) / len(stale)
        return out
