"""One device table: the health compute probe and MFU read the same peaks."""

from __future__ import annotations

import pytest

from trainguard.core.devices import BF16_PEAK_FLOPS
from trainguard.health.compute import peak_bf16_flops
from trainguard.telemetry.mfu import peak_flops


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA B200", 2.25e15),
        ("AMD Instinct MI300X", 1.3e15),
        ("cpu", None),
        (None, None),
    ],
)
def test_health_and_telemetry_agree(name: str | None, peak: float | None) -> None:
    assert peak_flops(name) == peak
    assert peak_bf16_flops(name) == peak


def test_every_entry_matches_itself() -> None:
    for key, peak in BF16_PEAK_FLOPS:
        assert peak_flops(f"NVIDIA {key}") == peak, key
