"""Closed-form checkpoint intervals from the literature (all durations in the same unit).

- Young (1974): ``tau = sqrt(2 * delta * M)``, first order.
- Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps",
  FGCS 22(3): ``tau = sqrt(2 delta M) * [1 + 1/3 sqrt(delta / 2M) + 1/9 (delta / 2M)] - delta``
  for ``delta < 2M``, else ``M``. ``tau`` is the *compute* time between checkpoints (the
  checkpoint time ``delta`` comes on top); that is the quantity his Table 1 reports (117, 57
  and 9.1 min for delta = 5 min and M = 24 h, 6 h, 15 min; his restart time R = 10 min does not
  enter the optimum).
- NVIDIA (Saxena et al., 2024) availability optimum:
  ``Tc = Ts + sqrt(2 (Tf + Tr) Ts + Ts^2)`` with save time Ts, mean time to failure Tf and
  restart time Tr; ``Tc`` is the period (save included).
"""

from __future__ import annotations

import math

__all__ = ["availability_interval", "daly_interval", "young_interval"]


def young_interval(delta: float, mtti: float) -> float:
    """Young's first-order optimum compute time between checkpoints."""
    _check(delta=delta, mtti=mtti)
    return math.sqrt(2.0 * delta * mtti)


def daly_interval(delta: float, mtti: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints (checkpoint time excluded)."""
    _check(delta=delta, mtti=mtti)
    if delta >= 2.0 * mtti:
        return mtti
    x = delta / (2.0 * mtti)
    return math.sqrt(2.0 * delta * mtti) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def availability_interval(save: float, mttf: float, restart: float) -> float:
    """NVIDIA's availability-optimal checkpoint period Ts + sqrt(2 (Tf + Tr) Ts + Ts^2)."""
    _check(save=save, mttf=mttf, restart=restart)
    return save + math.sqrt(2.0 * (mttf + restart) * save + save * save)


def _check(**values: float) -> None:
    for name, v in values.items():
        if not (v >= 0.0) or math.isinf(v):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
