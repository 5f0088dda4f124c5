"""The health policy: XIDs and counters → ignore / warn / restart / drain.

Defaults follow NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors; NVIDIA Health Validation
marks 46 and 48 critical/drain). Every entry can be overridden through ``[health.xid_policy]``
and ``[health.counter_policy]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from trainguard.core.config.health import COUNTER_CHECKS, check_action, validate_policy_overrides
from trainguard.health.result import Action, Finding

__all__ = ["COUNTER_CHECKS", "DEFAULT_COUNTER_POLICY", "DEFAULT_XID_POLICY", "Policy"]

DEFAULT_XID_POLICY: dict[int, tuple[Action, str]] = {
    13: (Action.RESTART, "graphics engine exception (usually the application)"),
    31: (Action.RESTART, "GPU memory page fault / MMU fault (usually the application)"),
    43: (Action.RESTART, "GPU stopped processing: application stopped"),
    45: (Action.RESTART, "preemptive cleanup after an earlier error"),
    46: (Action.DRAIN, "GPU stopped processing"),
    48: (Action.DRAIN, "double-bit ECC error"),
    63: (Action.WARN, "row-remap / page-retirement recording event: reset when convenient"),
    64: (Action.DRAIN, "row-remap / page-retirement recording failure"),
    74: (Action.DRAIN, "NVLink error"),
    79: (Action.DRAIN, "GPU has fallen off the bus: drain and reboot"),
    92: (Action.WARN, "high single-bit ECC error rate: watch, then drain"),
    94: (Action.RESTART, "contained ECC error: restart the job's processes"),
    95: (Action.DRAIN, "uncontained ECC error"),
    119: (Action.DRAIN, "GSP RPC timeout"),
    120: (Action.DRAIN, "GSP error"),
}

DEFAULT_COUNTER_POLICY: dict[str, Action] = {
    "gpu_missing": Action.DRAIN,
    "gpu_lost": Action.DRAIN,
    "ecc_dbe_volatile": Action.DRAIN,
    "ecc_dbe_aggregate": Action.WARN,
    "row_remap_failure": Action.DRAIN,
    "row_remap_pending": Action.WARN,
    "row_remap_uncorrectable": Action.WARN,
    "retired_pages_pending": Action.WARN,
    "nvlink_errors": Action.WARN,
    "pcie_replay": Action.WARN,
    "pcie_link_degraded": Action.WARN,
    "thermal_throttle": Action.IGNORE,
    "thermal_sustained": Action.WARN,
    "dcgm_health": Action.WARN,
    "host_disk_low": Action.WARN,
    "host_memory_low": Action.WARN,
    "rdzv_unreachable": Action.WARN,
    "clock_skew": Action.WARN,
    "compute_slow": Action.WARN,
    "allreduce_slow": Action.WARN,
}
if tuple(DEFAULT_COUNTER_POLICY) != COUNTER_CHECKS:  # the config validates against the names
    raise ImportError("health.policy: DEFAULT_COUNTER_POLICY and config COUNTER_CHECKS differ")


def _parse_action(value: str, where: str) -> Action:
    return Action(check_action(value, where))


@dataclass(slots=True)
class Policy:
    """The effective tables. Build with :meth:`from_config` or directly in tests."""

    xid: dict[int, tuple[Action, str]] = field(default_factory=lambda: dict(DEFAULT_XID_POLICY))
    counters: dict[str, Action] = field(default_factory=lambda: dict(DEFAULT_COUNTER_POLICY))
    unknown_xid: Action = Action.WARN

    @classmethod
    def from_overrides(
        cls,
        xid: Mapping[str, str] | None = None,
        counters: Mapping[str, str] | None = None,
        unknown_xid: str = "warn",
    ) -> Policy:
        validate_policy_overrides(xid or {}, counters or {})
        policy = cls(unknown_xid=_parse_action(unknown_xid, "unknown_xid_action"))
        for key, value in (xid or {}).items():
            code = int(str(key))
            meaning = DEFAULT_XID_POLICY.get(code, (Action.WARN, "XID"))[1]
            policy.xid[code] = (_parse_action(value, f"xid_policy[{key}]"), meaning)
        for key, value in (counters or {}).items():
            policy.counters[key] = _parse_action(value, f"counter_policy[{key}]")
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
