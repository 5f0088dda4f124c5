"""Configuration of the silent-data-corruption checks (section [sdc] of trainguard.toml, env
TRAINGUARD_SDC_*).

At step boundaries (``tg.checkpoint.maybe_save``) the ranks compare a digest of their
replicated state (the DDP model's parameters and buffers, the optimizer state), which must be
bitwise equal on every rank; a disagreement is silent data corruption on some rank: the odd
one out is named, the job rolls back to the last agreed step and redoes the steps since.
Example::

    [sdc]
    enabled = true
    budget = 0.005          # at most this share of the training time spent in checks
    # every_steps = 50      # a fixed cadence instead of the budget's (>= 1)
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_BUDGET = 0.0001
"""The smallest ``budget``: below it a check would come too rarely to bound the redone steps."""


@dataclass(kw_only=True, slots=True)
class SdcConfig:
    enabled: bool = True
    """Compare the ranks' replicated state at step boundaries (needs ``tg.checkpoint.maybe_save``
    in the loop and a DistributedDataParallel model in the checkpointed state)."""
    budget: float = 0.005
    """Share of the training time the checks may take (digest and the all-gather); the cadence
    follows from it, measured on the running job, the same on every rank."""
    every_steps: int | None = None
    """Check every this many steps (>= 1) instead of the cadence the budget gives (unset)."""
    metric: str = "loss"
    """The ``tg.log`` key a replay compares, step by step, with the first run's where no
    parameter digests are recorded (a tie of three ranks or more, ``replay_digests = false``):
    the first rank whose value differs computed wrongly first."""
    replay_digests: bool = True
    """With two ranks (no majority to name the odd one), digest each rank's parameters at
    every step boundary (local, a read of the parameters per step) so that a replay names the
    rank whose parameters diverged first; false: compare ``metric`` instead (free, but a
    corruption too small to change the logged value can get the wrong rank named). The records
    are charged to ``budget`` with the checks; where they alone take over half of it (measured
    over the first 200 steps: a model whose step costs little more than a read of its
    parameters), the job compares ``metric`` from then on, with one line."""
    evict: bool = True
    """In a job of several nodes, a named rank's node leaves the job (its workers exit with
    code 95, its agent evicts it as for a health drain; a spare or the nodes left go on from
    the last agreed checkpoint). A single-node job rolls back in place (evicting its only node
    would end it)."""
    max_verdicts: int = 3
    """Corruption verdicts in one job; the next one stops it with the "do not requeue" exit
    code (93): a device that corrupts this often must leave the job."""

    def __post_init__(self) -> None:
        if not self.budget >= MIN_BUDGET or self.budget > 0.5:
            raise ValueError(
                f"budget must be between {MIN_BUDGET:g} and 0.5 (a share of the step time), "
                f"not {self.budget!r}; enabled = false switches the checks off"
            )
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(
                f"every_steps must be >= 1 (check every N steps), not {self.every_steps}; leave "
                "it unset for the cadence the budget gives, or enabled = false for no checks"
            )
        if not self.metric:
            raise ValueError("metric must name a tg.log key, e.g. 'loss'")
        if self.max_verdicts < 1:
            raise ValueError("max_verdicts must be >= 1 (enabled = false switches the checks off)")
