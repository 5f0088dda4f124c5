"""The one return type of every health probe: :class:`ProbeResult`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from trainguard.core.contracts.actions import HealthAction

__all__ = [
    "Finding",
    "HealthAction",
    "ProbeResult",
    "Status",
    "action_status",
    "worst_action",
    "worst_status",
]


class Status(str, Enum):
    """Health of a source or node.

    ``OK`` healthy; ``WARN`` degraded (usable, someone should look); ``FAIL`` unhealthy (keep
    the node out); ``UNKNOWN`` the source could not tell (unreachable, unparsable, not present).
    """

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    UNKNOWN = "unknown"

    @property
    def severity(self) -> int:
        return _STATUS_SEVERITY[self]


_STATUS_SEVERITY = {Status.OK: 0, Status.UNKNOWN: 1, Status.WARN: 2, Status.FAIL: 3}


_ACTION_STATUS = {
    HealthAction.IGNORE: Status.OK,
    HealthAction.WARN: Status.WARN,
    HealthAction.RESTART: Status.WARN,
    HealthAction.DRAIN: Status.FAIL,
}


def action_status(action: HealthAction) -> Status:
    """Node status implied by an action: drain → fail, restart/warn → warn, ignore → ok."""
    return _ACTION_STATUS[action]


def worst_status(statuses: list[Status]) -> Status:
    return max(statuses, key=lambda s: s.severity, default=Status.OK)


def worst_action(actions: list[HealthAction]) -> HealthAction:
    return max(actions, key=lambda a: a.severity, default=HealthAction.IGNORE)


@dataclass(frozen=True, slots=True)
class Finding:
    """One observation a policy judged: ``check`` is the policy key (``xid.79``,
    ``ecc_dbe_volatile``, ``host_disk_low``...), ``gpu`` the GPU index or None for the host."""

    check: str
    action: HealthAction
    reason: str
    gpu: str | None = None


@dataclass(slots=True)
class ProbeResult:
    """What one source says about the node.

    ``status`` is derived from the findings (the worst action's status) unless the source could
    not tell (``UNKNOWN`` with ``error``). ``gpus`` holds per-GPU readings keyed by GPU index;
    ``details`` host-level readings. ``present`` is False when the source does not exist on
    this node (no NVML library, no dcgm-exporter): such a result does not count.
    """

    source: str
    status: Status = Status.OK
    findings: list[Finding] = field(default_factory=list)
    gpus: dict[str, dict[str, Any]] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    present: bool = True
    time: float = field(default_factory=time.time)
    duration_s: float = 0.0

    @property
    def action(self) -> HealthAction:
        return worst_action([f.action for f in self.findings])

    @property
    def reasons(self) -> list[str]:
        out = [f.reason for f in self.findings if f.action is not HealthAction.IGNORE]
        if self.error:
            out.append(self.error)
        return out

    def add(self, finding: Finding) -> None:
        self.findings.append(finding)
        self.status = worst_status([self.status, action_status(finding.action)])

    @classmethod
    def unknown(cls, source: str, error: str, *, present: bool = True) -> ProbeResult:
        return cls(source=source, status=Status.UNKNOWN, error=error, present=present)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "status": self.status.value,
            "action": self.action.value,
            "present": self.present,
            "reasons": self.reasons,
            "findings": [
                {"check": f.check, "action": f.action.value, "reason": f.reason, "gpu": f.gpu}
                for f in self.findings
            ],
            "gpus": self.gpus,
            "details": self.details,
            "error": self.error,
            "time": self.time,
            "duration_s": round(self.duration_s, 4),
        }
