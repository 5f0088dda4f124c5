"""Lemon nodes: a node whose history crosses the threshold is refused by every later job.

A lemon has ``lemon_failures`` incidents whose cause is one of ``lemon_causes`` within
``lemon_window_days``, counted since an operator last released it (``trainguard fleet release``).
An incident is one failed attempt of one job, however many records it left (the health
finding, the attribution, the eviction of one XID count once).

With ``[fleet] node_role`` only what the database stamped as written by the node's own role
counts (a record another writer planted for the node is left out, and counted as such), and
only a release by ``operator_role`` starts the count again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from trainguard.core.config.fleet import FleetConfig
from trainguard.fleet.db import FleetDB, Record

__all__ = ["Lemon", "incidents", "lemon_status"]


@dataclass(slots=True)
class Lemon:
    node: str
    incidents: int
    threshold: int
    window_days: float
    since: float
    history: list[dict[str, Any]] = field(default_factory=list)
    ignored: int = 0
    """Records of the node in the window left out: not written by the node's role."""

    @property
    def is_lemon(self) -> bool:
        return self.threshold > 0 and self.incidents >= self.threshold

    def reason(self) -> str:
        causes = sorted({h["cause"] for h in self.history})
        return (
            f"lemon node: {self.incidents} {'/'.join(causes) or 'counted'} incident(s) in the "
            f"last {self.window_days:g} days (threshold {self.threshold}); release it with "
            f"`trainguard fleet release {self.node}` once it is repaired"
        )


def incidents(records: list[Record], causes: list[str]) -> list[Record]:
    """The first record of each (job, attempt) whose cause counts."""
    seen: set[tuple[str, int, str]] = set()
    out = []
    for r in records:
        if r.cause not in causes or r.kind == "refused":
            continue
        key = (r.job, r.attempt, r.uid if r.attempt < 0 and not r.job else "")
        if key in seen:
            continue
        seen.add(key)
        out.append(r)
    return out


def lemon_status(db: FleetDB, node: str, cfg: FleetConfig, *, now: float | None = None) -> Lemon:
    now = time.time() if now is None else now
    since = now - cfg.lemon_window_days * 86400.0
    role = cfg.role_of(node)
    released = db.last_release(node, writer=cfg.operator_role if role else None)
    if released is not None:
        since = max(since, released)
    records = db.history(node, since=since)
    trusted = [r for r in records if r.writer == role] if role else records
    found = incidents(trusted, list(cfg.lemon_causes))
    history = [
        {
            "time": r.time,
            "job": r.job,
            "attempt": r.attempt,
            "kind": r.kind,
            "cause": r.cause,
            "verdict": r.verdict,
            "summary": str(r.detail.get("summary") or r.detail.get("reason") or "")[:300],
        }
        for r in found
    ]
    return Lemon(
        node, len(found), cfg.lemon_failures, cfg.lemon_window_days, since, history,
        ignored=len(records) - len(trusted),
    )  # fmt: skip
