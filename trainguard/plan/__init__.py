"""Goodput planner: an ETTR model of a training job (two checkpoint tiers, spares, badput by
cause), the classic interval formulas, and a Monte Carlo simulator that checks the model.

A library layer: imports numpy, the standard library and ``trainguard.core`` only.
"""

from trainguard.plan.formulas import availability_interval, daly_interval, young_interval
from trainguard.plan.model import (
    CAUSES,
    Estimate,
    JobSpec,
    Tier,
    evaluate,
    optimize,
    recommend_spares,
    sensitivity,
)

__all__ = [
    "CAUSES",
    "Estimate",
    "JobSpec",
    "Tier",
    "availability_interval",
    "daly_interval",
    "evaluate",
    "optimize",
    "recommend_spares",
    "sensitivity",
    "young_interval",
]
