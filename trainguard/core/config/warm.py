"""Configuration of warm starts (section [warm], env TRAINGUARD_WARM_*).

Example::

    [warm]
    enabled = true            # --no-tg-warm: every worker starts cold, as under torchrun
    prestart_delay_s = 5.0
    setup_gc_hold_s = 60.0    # 0: the collector runs from the first line, as under torchrun
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class WarmConfig:
    enabled: bool = True
    """Start workers from pre-started processes that already imported ``preload`` (one per
    local rank): a restart, and a spare's first start when it takes a dead node's slot, skip
    interpreter start-up and the torch import; a node's first start runs them while the agent
    sets up. ``--no-tg-warm`` turns it off."""
    preload: list[str] = field(
        default_factory=lambda: [
            "torch",
            "torch.distributed",
            "torch.nn.parallel",
            "torch.distributed.checkpoint",
            # DistributedDataParallel's constructor imports these (~800 modules, seconds)
            "torch._dynamo",
            "torch._inductor",
            "torch._numpy",
            "torch.onnx",
            "trainguard.worker.api",
            "trainguard.checkpoint.manager",
        ]
    )
    """Modules a warm process imports before it waits (import errors are ignored there: the
    worker meets them itself)."""
    prestart_delay_s: float = 5.0
    """Seconds after a start before the warm processes for the next restart are started (they
    would otherwise compete for CPU with the starting workers). A spare starts its own at once."""

    setup_gc_hold_s: float = 60.0
    """Each worker runs its set-up (imports, model, optimizer) with Python's cyclic garbage
    collector off, until its first ``tg.step()`` ends or this many seconds passed, whichever
    comes first; then the collector runs as usual (nothing is kept from it). The collections
    that torch's ~2 000 modules trigger while they import walk every object so far each time:
    ~25 % of a cold worker's start-up CPU. 0 turns it off. Applies where warm starts are on."""

    def __post_init__(self) -> None:
        if self.prestart_delay_s < 0:
            raise ValueError("prestart_delay_s must be >= 0")
        if self.setup_gc_hold_s < 0:
            raise ValueError("setup_gc_hold_s must be >= 0")
