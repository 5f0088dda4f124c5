"""Facts about accelerators that more than one feature needs, in one table.

Dense BF16 peak FLOP/s from the vendors' datasheets (NVIDIA H100/H200/GH200, A100, B200;
AMD MI300X): the health compute probe compares a node's measured GEMM rate with it, telemetry
divides achieved FLOP/s by it (MFU). An unknown device has no peak (never a made-up number).
"""

from __future__ import annotations

__all__ = ["BF16_PEAK_FLOPS", "peak_bf16_flops"]

BF16_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM (and HBM3 NVL parts report like SXM)
    ("GH200", 989e12),
    ("H200", 989e12),
    ("B200", 2.25e15),
    ("A100", 312e12),
    ("MI300X", 1.3e15),
)
"""(words of the device name, dense BF16 peak FLOP/s); the first entry whose every word is in
the device name (case-insensitive) wins, so the most specific comes first."""


def peak_bf16_flops(device_name: str | None) -> float | None:
    """Dense BF16 peak of a device such as ``NVIDIA H100 80GB HBM3``, else None."""
    if not device_name:
        return None
    name = device_name.upper()
    for key, peak in BF16_PEAK_FLOPS:
        if all(word in name for word in key.upper().split()):
            return peak
    return None
