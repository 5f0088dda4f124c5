"""The one return type of every health probe: :class:`ProbeResult`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["Action", "Finding", "ProbeResult", "Status", "worst_action", "worst_status"]


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


class Action(str, Enum):
    """What to do about a finding, least to most severe.

    ``IGNORE`` nothing; ``WARN`` report; ``RESTART`` restart the job's processes on this node;
    ``DRAIN`` take the node out of the job (a spare replaces it) and out of the scheduler.
    """

    IGNORE = "ignore"
    WARN = "warn"
    RESTART = "restart"
    DRAIN = "drain"

    @property
    def severity(self) -> int:
        return _ACTION_ORDER.index(self)

    @property
    def status(self) -> Status:
        """Node status implied by this action: drain → fail, restart/warn → warn."""
        if self is Action.DRAIN:
            return Status.FAIL
        if self is Action.IGNORE:
            return Status.OK
        return Status.WARN


_ACTION_ORDER = [Action.IGNORE, Action.WARN, Action.RESTART, Action.DRAIN]


def worst_status(statuses: list[Status]) -> Status:
    return max(statuses, key=lambda s: s.severity, default=Status.OK)


def worst_action(actions: list[Action]) -> Action:
    return max(actions, key=lambda a: a.severity, default=Action.IGNORE)


@dataclass(frozen=True, slots=True)
class Finding:
    """One observation a policy judged: ``check`` is the policy key (``xid.79``,
    ``ecc_dbe_volatile``, ``host_disk_low``...), ``gpu`` the GPU index or None for the host."""

    check: str
    action: Action
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
    def action(self) -> Action:
        return worst_action([f.action for f in self.findings])

    @property
    def reasons(self) -> list[str]:
        out = [f.reason for f in self.findings if f.action is not Action.IGNORE]
        if self.error:
            out.append(self.error)
        return out

    def add(self, finding: Finding) -> None:
        self.findings.append(finding)
        self.status = worst_status([self.status, finding.action.status])

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
