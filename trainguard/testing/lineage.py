"""Productive time measured without trainguard: which step executions the final weights
descend from.

``examples/fault_toy.py --timing FILE`` writes, for every step rank 0 runs, its start and end
time, its loss and a hash of the parameters before and after it. The final weights are the
``after`` of the newest execution; walking back through ``before`` hashes (each time to the
newest earlier execution that produced them) gives the chain of executions the result is made
of. Productive time = the durations of the chain's executions whose loss is finite. Executions
off the chain (redone after a restart, discarded by a rollback) and steps with a NaN/Inf loss
(a model gone to NaN trains nothing) are lost time.
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path
from typing import TypedDict

__all__ = ["Exec", "chain", "productive_s", "read_timing"]


class Exec(TypedDict):
    """One step execution as ``fault_toy.py --timing`` writes it."""

    t0: float
    t1: float
    loss: float
    before: str
    """A hash of the parameters before the step."""
    after: str


def read_timing(path: Path) -> list[Exec]:
    out: list[Exec] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return sorted(out, key=lambda e: e["t1"])


def chain(execs: list[Exec], *, until: float | None = None) -> list[Exec]:
    """The executions the newest state (at ``until``, default the end) descends from, oldest
    first."""
    if until is not None:
        execs = [e for e in execs if e["t1"] <= until]
    if not execs:
        return []
    by_after: dict[str, list[float]] = {}
    index: dict[tuple[str, float], Exec] = {}
    for e in execs:
        by_after.setdefault(e["after"], []).append(e["t1"])
        index[(e["after"], e["t1"])] = e
    cur = execs[-1]
    out = [cur]
    while True:
        ends = by_after.get(cur["before"], [])
        i = bisect.bisect_right(ends, cur["t0"])
        if i == 0:
            break
        cur = index[(cur["before"], ends[i - 1])]
        out.append(cur)
    return out[::-1]


def _finite(e: Exec) -> bool:
    return math.isfinite(float(e["loss"]))


def productive_s(execs: list[Exec], *, until: float | None = None) -> float:
    """Durations of the chain's finite-loss executions. A run whose model ends broken (the
    newest execution's loss is NaN/Inf, and every one since some point) is credited with what
    it had made when it broke for good: the chain as of the start of that all-bad stretch."""
    if until is not None:
        execs = [e for e in execs if e["t1"] <= until]
    if execs and not _finite(execs[-1]):
        i = len(execs)
        while i > 0 and not _finite(execs[i - 1]):
            i -= 1
        if i == 0:
            return 0.0
        return productive_s(execs[:i], until=execs[i]["t0"])
    return sum(e["t1"] - e["t0"] for e in chain(execs) if _finite(e))
