"""Judge per-GPU readings (from dcgm-exporter, NVML or DCGM) against the policy.

Every GPU source turns what it reads into the same reading dict (keys below, all optional),
so the rules live in one place:

``xid`` (last XID, 0 = none), ``xid_msg``, ``xid_counts`` ({code: count}), ``temp_c``,
``ecc_dbe_volatile``, ``ecc_dbe_aggregate``, ``row_remap_failure``, ``row_remap_pending``,
``row_remap_uncorrectable``, ``retired_pages_pending``, ``nvlink_errors``, ``pcie_replay``,
``pcie_width``/``pcie_width_max``, ``pcie_gen``/``pcie_gen_max``, ``clocks_event_reasons``,
``lost`` (the driver's error text when the GPU is lost or needs a reset).
"""

from __future__ import annotations

from typing import Any

from trainguard.core.config.health import HealthConfig
from trainguard.health.policy import Policy
from trainguard.health.result import Finding, HealthAction, ProbeResult

__all__ = ["THERMAL_REASONS", "ThermalTracker", "evaluate_gpus"]

SW_THERMAL = 0x20
HW_THERMAL = 0x40
THERMAL_REASONS = SW_THERMAL | HW_THERMAL


class ThermalTracker:
    """Counts consecutive samples with a thermal clock slowdown, per GPU (kept by a source
    across probes so in-job probing can tell sustained throttling from a blip)."""

    def __init__(self) -> None:
        self.consecutive: dict[str, int] = {}

    def update(self, gpu: str, throttled: bool) -> int:
        n = self.consecutive.get(gpu, 0) + 1 if throttled else 0
        self.consecutive[gpu] = n
        return n


def _num(reading: dict[str, Any], key: str) -> float:
    v = reading.get(key)
    return float(v) if isinstance(v, int | float) else 0.0


def evaluate_gpus(
    result: ProbeResult,
    readings: dict[str, dict[str, Any]],
    *,
    policy: Policy,
    cfg: HealthConfig,
    thermal: ThermalTracker | None = None,
) -> None:
    """Add findings for ``readings`` (GPU index → reading) to ``result`` and store them."""
    result.gpus.update(readings)
    result.details["num_gpus"] = len(readings)
    if cfg.expect_gpus is not None and len(readings) < cfg.expect_gpus:
        result.add(
            policy.finding(
                "gpu_missing",
                f"{len(readings)} GPUs visible, {cfg.expect_gpus} expected "
                "(a GPU fell off the bus or is hidden)",
            )
        )
    thermal = thermal or ThermalTracker()
    for gpu, r in sorted(readings.items(), key=lambda kv: _gpu_key(kv[0])):
        if r.get("lost"):
            result.add(policy.finding("gpu_lost", f"GPU unreachable: {r['lost']}", gpu=gpu))
        _xids(result, gpu, r, policy=policy, cfg=cfg)
        _memory_errors(result, gpu, r, policy=policy)
        _link_errors(result, gpu, r, policy=policy, cfg=cfg)
        _thermal(result, gpu, r, policy=policy, cfg=cfg, tracker=thermal)


def _memory_errors(result: ProbeResult, gpu: str, r: dict[str, Any], *, policy: Policy) -> None:
    """Double-bit ECC errors, row remapping and page retirement of one GPU."""
    if _num(r, "ecc_dbe_volatile") > 0:
        result.add(
            policy.finding(
                "ecc_dbe_volatile",
                f"{int(_num(r, 'ecc_dbe_volatile'))} volatile double-bit ECC error(s)",
                gpu=gpu,
            )
        )
    if _num(r, "ecc_dbe_aggregate") > 0 and _num(r, "ecc_dbe_volatile") == 0:
        result.add(
            policy.finding(
                "ecc_dbe_aggregate",
                f"{int(_num(r, 'ecc_dbe_aggregate'))} double-bit ECC error(s) since the "
                "counters were reset",
                gpu=gpu,
            )
        )
    if _num(r, "row_remap_failure") > 0:
        result.add(policy.finding("row_remap_failure", "row remapping failed", gpu=gpu))
    if _num(r, "row_remap_pending") > 0:
        result.add(
            policy.finding(
                "row_remap_pending", "row remap pending: reset the GPU when convenient", gpu=gpu
            )
        )
    if _num(r, "row_remap_uncorrectable") > 0:
        result.add(
            policy.finding(
                "row_remap_uncorrectable",
                f"{int(_num(r, 'row_remap_uncorrectable'))} rows remapped for uncorrectable errors",
                gpu=gpu,
            )
        )
    if _num(r, "retired_pages_pending") > 0:
        result.add(
            policy.finding(
                "retired_pages_pending", "page retirement pending (reset needed)", gpu=gpu
            )
        )


def _link_errors(
    result: ProbeResult, gpu: str, r: dict[str, Any], *, policy: Policy, cfg: HealthConfig
) -> None:
    """NVLink errors, PCIe replays and a PCIe link below its width of one GPU."""
    if _num(r, "nvlink_errors") > cfg.nvlink_error_threshold:
        result.add(
            policy.finding(
                "nvlink_errors",
                f"{int(_num(r, 'nvlink_errors'))} NVLink CRC/replay/recovery errors",
                gpu=gpu,
            )
        )
    if _num(r, "pcie_replay") > cfg.pcie_replay_threshold:
        result.add(
            policy.finding("pcie_replay", f"{int(_num(r, 'pcie_replay'))} PCIe replays", gpu=gpu)
        )
    width, width_max = _num(r, "pcie_width"), _num(r, "pcie_width_max")
    if width and width_max and width < width_max:
        result.add(
            policy.finding(
                "pcie_link_degraded",
                f"PCIe link x{int(width)} below its maximum x{int(width_max)}",
                gpu=gpu,
            )
        )


def _xids(
    result: ProbeResult, gpu: str, r: dict[str, Any], *, policy: Policy, cfg: HealthConfig
) -> None:
    counts = {int(c): int(n) for c, n in (r.get("xid_counts") or {}).items() if n}
    last = int(_num(r, "xid"))
    codes = sorted(set(counts) | ({last} if last else set()))
    for code in codes:
        n = counts.get(code, 0)
        msg = r.get("xid_msg") if code == last else None
        if n > 1 or (n and not msg):
            msg = f"{msg}; {n} occurrences" if msg else f"{n} occurrence(s)"
        finding = policy.xid_finding(code, gpu=gpu, msg=msg)
        if (
            cfg.xid_escalate_after
            and n >= cfg.xid_escalate_after
            and finding.action in (HealthAction.WARN, HealthAction.RESTART)
        ):
            finding = Finding(
                check=finding.check,
                action=HealthAction.DRAIN,
                reason=f"{finding.reason} (escalated: {n} >= {cfg.xid_escalate_after})",
                gpu=gpu,
            )
        result.add(finding)


def _thermal(
    result: ProbeResult,
    gpu: str,
    r: dict[str, Any],
    *,
    policy: Policy,
    cfg: HealthConfig,
    tracker: ThermalTracker,
) -> None:
    reasons = int(_num(r, "clocks_event_reasons"))
    throttled = bool(reasons & THERMAL_REASONS)
    n = tracker.update(gpu, throttled)
    if not throttled:
        return
    temp = _num(r, "temp_c")
    text = f"thermal clock slowdown (clocks event reasons 0x{reasons:x}, {temp:.0f} C)"
    if n >= cfg.thermal_sustain_samples or temp >= cfg.thermal_temp_c:
        why = f"{n} consecutive samples" if n >= cfg.thermal_sustain_samples else "hot"
        result.add(policy.finding("thermal_sustained", f"sustained {text}, {why}", gpu=gpu))
    else:
        result.add(policy.finding("thermal_throttle", text, gpu=gpu))


def _gpu_key(gpu: str) -> tuple[int, str]:
    return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)
