"""Model FLOPs utilisation: the device peak, the TorchTitan formula and a FLOP counter wrapper.

MFU = achieved FLOP/s of one device / the device's dense BF16 peak. An unknown device gets no
MFU (never a made-up one): :class:`PeakResolver` warns once and returns ``None``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from trainguard.core.devices import peak_bf16_flops

__all__ = [
    "PeakResolver",
    "count_flops",
    "mfu",
    "peak_flops",
    "transformer_flops_per_token",
]

logger = logging.getLogger(__name__)


def peak_flops(device_name: str | None) -> float | None:
    """Peak dense BF16 FLOP/s for a device name such as ``NVIDIA H100 80GB HBM3``, else None
    (the table is :data:`trainguard.core.devices.BF16_PEAK_FLOPS`)."""
    return peak_bf16_flops(device_name)


class PeakResolver:
    """Resolves the peak once per device name; an override wins; unknown → None + one warning."""

    def __init__(self, *, override: float | None = None, device_name: str | None = None) -> None:
        self.override = override
        self.device_name = device_name
        self._warned: set[str] = set()

    def peak(self, reported_device: str | None) -> float | None:
        if self.override is not None:
            return self.override
        name = self.device_name or reported_device or "unknown"
        value = peak_flops(name)
        if value is None and name not in self._warned:
            self._warned.add(name)
            logger.warning(
                "MFU omitted: no peak FLOP/s known for device %r; set [telemetry] peak_flops "
                "(TRAINGUARD_TELEMETRY_PEAK_FLOPS) to report it",
                name,
            )
        return value


def mfu(flops_per_step: float, step_time_s: float, peak: float) -> float:
    """Fraction (0..1) of ``peak`` achieved by ``flops_per_step`` done in ``step_time_s``."""
    return flops_per_step / step_time_s / peak


def transformer_flops_per_token(
    *, num_params: int, num_layers: int, num_heads: int, head_dim: int, seq_len: int
) -> float:
    """TorchTitan's training FLOPs per token: ``6·N + 6·layers·heads·head_dim·seq_len``
    (the second term is attention; the embedding parameters are usually excluded from N)."""
    return 6.0 * num_params + 6.0 * num_layers * num_heads * head_dim * seq_len


def count_flops(fn: Callable[[], object]) -> tuple[Any, float]:
    """Run ``fn()`` under ``torch.utils.flop_counter.FlopCounterMode``; return (result, FLOPs)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        out = fn()
    return out, float(counter.get_total_flops())
