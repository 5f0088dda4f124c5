"""The agent's side of the sniff tests (``[fleet] sniff_*``; the workers run them in
``tg.step()``, :mod:`trainguard.worker.sniff`): each local rank's ``sniff`` records are judged
against a reference, a rank that became slow is flagged, recorded in the fleet database and
handled by ``[health] straggler_policy``.

The reference of a rank's GEMM time is the median of the node's other ranks at the same sniff
(the same load, the same moment), times the rank's own standing among them over its first
``sniff_window`` sniffs (a rank that has *become* slow: ranks of one node differ a little,
steadily, by placement, and on a shared machine by more), or, for a rank alone on its node, the fleet's history for the
same device model and GEMM size (the median of earlier jobs' sniff records, at least
``_MIN_BASELINE`` of them, flagged ones left out). A rank whose GEMM takes
``sniff_slow_factor`` times its reference in the median of its last ``sniff_window`` sniffs
(most of them: one outlier is not a flag) is flagged once per attempt.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from trainguard.core.config.fleet import FleetConfig
from trainguard.fleet.db import FleetDB

__all__ = ["SniffJudge", "fleet_baseline"]

_MIN_BASELINE = 3
_BASELINE_DAYS = 30.0


def _key(model: str, size: int) -> str:
    return f"{model}|{size}"


def fleet_baseline(
    db: FleetDB, *, now: float | None = None, cfg: FleetConfig | None = None
) -> dict[str, float]:
    """Median GEMM seconds of the fleet's sniff records per device model and GEMM size
    (``"<model>|<size>"``), from unflagged records of the last 30 days (with ``[fleet]
    node_role``, only those the database stamped as written by their node's role)."""
    now = time.time() if now is None else now
    seen: dict[str, list[float]] = {}
    for r in db.history_of_kind("sniff", since=now - _BASELINE_DAYS * 86400.0):
        if r.cause != "ok":
            continue
        if cfg is not None and cfg.node_role and r.writer != cfg.role_of(r.node):
            continue
        d = r.detail
        try:
            seen.setdefault(_key(str(d["device_model"]), int(d["gemm_size"])), []).append(
                float(d["gemm_s"])
            )
        except (KeyError, TypeError, ValueError):
            continue
    return {k: statistics.median(v) for k, v in seen.items() if len(v) >= _MIN_BASELINE}


@dataclass(slots=True)
class _Rank:
    ratios: list[float] = field(default_factory=list)
    """Its last ``sniff_window`` slowdowns (GEMM time over the reference)."""
    calib: list[float] = field(default_factory=list)
    calibration: float | None = None
    """Against the node's other ranks: the median of its first ``sniff_window`` GEMM times
    over theirs (ranks of one node differ a little, steadily: what counts is a change)."""
    flagged: bool = False
    pending: list[dict[str, Any]] = field(default_factory=list)
    """Results since the last summary record."""
    last: dict[str, Any] | None = None


class SniffJudge:
    """Pure logic: :meth:`add` each local rank's sniff records, :meth:`judge` returns the
    newly flagged ranks (each once)."""

    def __init__(self, cfg: FleetConfig, baseline: dict[str, float] | None = None) -> None:
        self.cfg = cfg
        self.baseline = dict(baseline or {})
        self.ranks: dict[int, _Rank] = {}
        self._by_step: dict[int, dict[int, dict[str, Any]]] = {}
        self._judged: set[int] = set()

    def add(self, record: dict[str, Any]) -> None:
        if not isinstance(record.get("gemm_s"), (int, float)) or record["gemm_s"] <= 0:
            return
        rank, step = int(record["rank"]), int(record["step"])
        self._by_step.setdefault(step, {})[rank] = record
        r = self.ranks.setdefault(rank, _Rank())
        r.pending.append(record)
        r.last = record

    def reference(self, rank: int, step: int) -> tuple[float | None, str]:
        """(seconds, ``job`` | ``fleet``) the GEMM of ``rank`` at ``step`` is compared with."""
        same = self._by_step.get(step, {})
        others = [float(rec["gemm_s"]) for q, rec in same.items() if q != rank]
        if others:
            return statistics.median(others), "job"
        rec = same.get(rank)
        if rec is None:
            return None, ""
        base = self.baseline.get(_key(str(rec.get("device_model")), int(rec.get("gemm_size", 0))))
        return (base, "fleet") if base else (None, "")

    def judge(self, *, expected_ranks: int) -> list[dict[str, Any]]:
        """Judge every sniff step all ``expected_ranks`` local ranks reported (or older ones
        that never will); returns the newly flagged ranks."""
        found: list[dict[str, Any]] = []
        steps = sorted(self._by_step)
        for i, step in enumerate(steps):
            if step in self._judged:
                continue
            complete = len(self._by_step[step]) >= expected_ranks or i < len(steps) - 1
            if not complete:
                break
            self._judged.add(step)
            for rank, rec in sorted(self._by_step[step].items()):
                ref, source = self.reference(rank, step)
                r = self.ranks[rank]
                if ref is None or ref <= 0:
                    continue
                ratio = float(rec["gemm_s"]) / ref
                if source == "job":  # against the rank's own standing among its peers
                    if r.calibration is None:
                        r.calib.append(ratio)
                        if len(r.calib) >= self.cfg.sniff_window:
                            r.calibration = statistics.median(r.calib)
                        continue
                    ratio /= r.calibration
                rec["ratio"] = round(ratio, 3)
                r.ratios = [*r.ratios, ratio][-self.cfg.sniff_window :]
                slow = statistics.median(r.ratios)
                if (
                    len(r.ratios) >= self.cfg.sniff_window
                    and slow >= self.cfg.sniff_slow_factor
                    and not r.flagged
                ):
                    r.flagged = True
                    found.append(
                        {
                            "rank": rank,
                            "step": step,
                            "ratio": round(slow, 3),
                            "gemm_s": float(rec["gemm_s"]),
                            "reference_s": ref,
                            "reference": source,
                            "device_model": rec.get("device_model"),
                            "gemm_size": rec.get("gemm_size"),
                            "sniffs": sum(q >= self.cfg.sniff_slow_factor for q in r.ratios),
                            "window": list(map(lambda q: round(q, 3), r.ratios)),
                            "calibration": r.calibration,
                        }
                    )
        for step in steps[:-8]:  # keep the last few: late records of a slow rank
            if step in self._judged:
                self._by_step.pop(step, None)
        return found

    def take_summaries(self) -> list[dict[str, Any]]:
        """Per rank, the median of the results since the last call (what the fleet database
        keeps of them); empties the pending lists."""
        out = []
        for rank, r in sorted(self.ranks.items()):
            if not r.pending:
                continue
            last = r.pending[-1]
            out.append(
                {
                    "rank": rank,
                    "device_model": last.get("device_model"),
                    "gemm_size": last.get("gemm_size"),
                    "gemm_s": statistics.median(float(p["gemm_s"]) for p in r.pending),
                    "allreduce_s": _median_of(r.pending, "allreduce_s"),
                    "overhead": last.get("overhead"),
                    "samples": len(r.pending),
                    "flagged": r.flagged,
                }
            )
            r.pending = []
        return out


def _median_of(records: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(p[key]) for p in records if isinstance(p.get(key), (int, float))]
    return statistics.median(vals) if vals else None
