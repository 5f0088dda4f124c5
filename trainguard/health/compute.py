"""The compute probe: a GEMM of about a second (bf16 on GPU against the device peak, fp32 on CPU)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from trainguard.core.devices import peak_bf16_flops

__all__ = ["ComputeResult", "gemm_probe", "peak_bf16_flops"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ComputeResult:
    device: str
    dtype: str
    size: int
    iterations: int
    seconds: float
    flops_per_s: float
    peak_flops_per_s: float | None

    @property
    def fraction_of_peak(self) -> float | None:
        if not self.peak_flops_per_s:
            return None
        return self.flops_per_s / self.peak_flops_per_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "size": self.size,
            "iterations": self.iterations,
            "seconds": round(self.seconds, 4),
            "tflops": round(self.flops_per_s / 1e12, 4),
            "peak_tflops": None if self.peak_flops_per_s is None else self.peak_flops_per_s / 1e12,
            "fraction_of_peak": None
            if self.fraction_of_peak is None
            else round(self.fraction_of_peak, 4),
        }


def gemm_probe(
    duration_s: float = 1.0, *, device: str | None = None, size: int | None = None
) -> ComputeResult:
    """Multiply square matrices for about ``duration_s`` and report the achieved FLOP/s."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    n = size or (8192 if cuda else 512)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    # Warm up and size one batch so the timed loop lasts about duration_s.
    torch.matmul(a, b)
    sync()
    t0 = time.perf_counter()
    torch.matmul(a, b)
    sync()
    one = max(time.perf_counter() - t0, 1e-6)
    iters = max(1, int(duration_s / one))
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b)
    sync()
    dt = time.perf_counter() - t0
    flops = 2.0 * n**3 * iters / dt
    return ComputeResult(
        device=name,
        dtype=str(dtype).removeprefix("torch."),
        size=n,
        iterations=iters,
        seconds=dt,
        flops_per_s=flops,
        peak_flops_per_s=peak_bf16_flops(name) if cuda else None,
    )
