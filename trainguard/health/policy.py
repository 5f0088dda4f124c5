"""The health policy: XIDs and counters → ignore / warn / restart / drain.

Defaults follow NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors; NVIDIA Health Validation
marks 46 and 48 critical/drain). Every entry can be overridden through ``[health.xid_policy]``
and ``[health.counter_policy]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from trainguard.core.config.health import COUNTER_CHECKS, validate_policy_overrides
from trainguard.core.contracts.actions import HealthAction
from trainguard.health.result import Finding

__all__ = ["COUNTER_CHECKS", "DEFAULT_COUNTER_POLICY", "DEFAULT_XID_POLICY", "Policy"]

DEFAULT_XID_POLICY: dict[int, tuple[HealthAction, str]] = {
    13: (HealthAction.RESTART, "graphics engine exception (usually the application)"),
    31: (HealthAction.RESTART, "GPU memory page fault / MMU fault (usually the application)"),
    43: (HealthAction.RESTART, "GPU stopped processing: application stopped"),
    45: (HealthAction.RESTART, "preemptive cleanup after an earlier error"),
    46: (HealthAction.DRAIN, "GPU stopped processing"),
    48: (HealthAction.DRAIN, "double-bit ECC error"),
    63: (HealthAction.WARN, "row-remap / page-retirement recording event: reset when convenient"),
    64: (HealthAction.DRAIN, "row-remap / page-retirement recording failure"),
    74: (HealthAction.DRAIN, "NVLink error"),
    79: (HealthAction.DRAIN, "GPU has fallen off the bus: drain and reboot"),
    92: (HealthAction.WARN, "high single-bit ECC error rate: watch, then drain"),
    94: (HealthAction.RESTART, "contained ECC error: restart the job's processes"),
    95: (HealthAction.DRAIN, "uncontained ECC error"),
    119: (HealthAction.DRAIN, "GSP RPC timeout"),
    120: (HealthAction.DRAIN, "GSP error"),
}

DEFAULT_COUNTER_POLICY: dict[str, HealthAction] = {
    "gpu_missing": HealthAction.DRAIN,
    "gpu_lost": HealthAction.DRAIN,
    "ecc_dbe_volatile": HealthAction.DRAIN,
    "ecc_dbe_aggregate": HealthAction.WARN,
    "row_remap_failure": HealthAction.DRAIN,
    "row_remap_pending": HealthAction.WARN,
    "row_remap_uncorrectable": HealthAction.WARN,
    "retired_pages_pending": HealthAction.WARN,
    "nvlink_errors": HealthAction.WARN,
    "pcie_replay": HealthAction.WARN,
    "pcie_link_degraded": HealthAction.WARN,
    "thermal_throttle": HealthAction.IGNORE,
    "thermal_sustained": HealthAction.WARN,
    "dcgm_health": HealthAction.WARN,
    "host_disk_low": HealthAction.WARN,
    "host_memory_low": HealthAction.WARN,
    "rdzv_unreachable": HealthAction.WARN,
    "clock_skew": HealthAction.WARN,
    "compute_slow": HealthAction.WARN,
    "allreduce_slow": HealthAction.WARN,
}
if tuple(DEFAULT_COUNTER_POLICY) != COUNTER_CHECKS:  # the config validates against the names
    raise ImportError("health.policy: DEFAULT_COUNTER_POLICY and config COUNTER_CHECKS differ")


@dataclass(slots=True)
class Policy:
    """The effective tables. Build with :meth:`from_config` or directly in tests."""

    xid: dict[int, tuple[HealthAction, str]] = field(
        default_factory=lambda: dict(DEFAULT_XID_POLICY)
    )
    counters: dict[str, HealthAction] = field(default_factory=lambda: dict(DEFAULT_COUNTER_POLICY))
    unknown_xid: HealthAction = HealthAction.WARN

    @classmethod
    def from_overrides(
        cls,
        xid: Mapping[str, str] | None = None,
        counters: Mapping[str, str] | None = None,
        unknown_xid: str = "warn",
    ) -> Policy:
        validate_policy_overrides(xid or {}, counters or {})
        policy = cls(unknown_xid=HealthAction.parse(unknown_xid, "unknown_xid_action"))
        for key, value in (xid or {}).items():
            code = int(str(key))
            meaning = DEFAULT_XID_POLICY.get(code, (HealthAction.WARN, "XID"))[1]
            policy.xid[code] = (HealthAction.parse(value, f"xid_policy[{key}]"), meaning)
        for key, value in (counters or {}).items():
            policy.counters[key] = HealthAction.parse(value, f"counter_policy[{key}]")
        return policy

    def xid_finding(self, code: int, *, gpu: str | None, msg: str | None = None) -> Finding:
        action, meaning = self.xid.get(code, (self.unknown_xid, "XID not in the policy table"))
        where = f"GPU {gpu}: " if gpu is not None else ""
        text = f"{where}XID {code} ({meaning})"
        if msg:
            text += f": {msg}"
        return Finding(check=f"xid.{code}", action=action, reason=text, gpu=gpu)

    def finding(self, check: str, reason: str, *, gpu: str | None = None) -> Finding:
        action = self.counters[check]
        where = f"GPU {gpu}: " if gpu is not None else ""
        return Finding(check=check, action=action, reason=where + reason, gpu=gpu)
