"""Where a hung job is stuck: every rank's last collective and Python stacks, analysed.

Pure analysis of what :mod:`trainguard.health.hangcollect` (the agent) or ``trainguard debug``
collected: one :class:`RankDump` per rank in, one :class:`Diagnosis` out (:func:`analyse`).
Nothing here reads a file, the store or a process.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from trainguard.core.flight_recorder import CollectiveState, parse_trace
from trainguard.health.stacktext import aggregate_stacks, main_frame

__all__ = ["Diagnosis", "RankDump", "analyse"]


@dataclass(slots=True)
class RankDump:
    rank: int
    host: str
    source: str
    """``flight_recorder`` (the worker answered), ``progress`` (its last progress record:
    frozen or silent) or ``none``."""
    collectives: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per process group: CollectiveState.to_json()."""
    stack: str = ""
    process_state: str | None = None

    def state(self, pg: str) -> CollectiveState | None:
        d = self.collectives.get(pg)
        return CollectiveState(**d) if d else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankDump:
        return cls(**d)

    @classmethod
    def from_trace(cls, rank: int, host: str, trace: dict[str, Any], **kw: Any) -> RankDump:
        colls = {pg: s.to_json() for pg, s in parse_trace(trace).items()}
        return cls(rank, host, "flight_recorder", colls, **kw)


@dataclass(slots=True)
class Diagnosis:
    kind: str
    """``missing`` (ranks never entered the collective the others wait in), ``divergent``
    (ranks in different collectives: a code path taken by some ranks only), ``transport``
    (every rank entered the same collective, none completed: network / peer) or ``unknown``."""
    message: str
    pg: str | None = None
    op: str | None = None
    seq: int | None = None
    """The collective the job is stuck in (sequence id in process group ``pg``)."""
    suspect_ranks: list[int] = field(default_factory=list)
    suspect_hosts: list[str] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)
    """Ranks grouped by (last collective entered, completed): op, seq, ranks, hosts."""
    frames: list[dict[str, Any]] = field(default_factory=list)
    """Ranks grouped by the innermost frame of their main thread."""
    stacks: list[dict[str, Any]] = field(default_factory=list)
    """Identical stacks aggregated: {"ranks": [...], "stack": text}."""
    missing_dumps: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _fmt_ranks(ranks: list[int]) -> str:
    return "{" + ",".join(str(r) for r in sorted(ranks)) + "}"


def _pick_pg(dumps: dict[int, RankDump]) -> str | None:
    """The process group to judge: the default one when any rank is in flight in it, else the
    first group with a rank in flight, else the default."""
    pgs: dict[str, bool] = {}
    for d in dumps.values():
        for pg, s in d.collectives.items():
            pgs[pg] = pgs.get(pg, False) or s["entered"] > s["completed"]
    if not pgs:
        return None
    flying = sorted(pg for pg, f in pgs.items() if f)
    default = next((pg for pg in sorted(pgs) if pg.startswith("0:")), sorted(pgs)[0])
    if default in flying or not flying:
        return default
    return flying[0]


def _where(s: CollectiveState, source: str) -> str:
    if source != "flight_recorder":
        return f"last seen after #{s.completed}"
    if s.in_flight:
        return f"in {s.op or 'collective'} #{s.entered}"
    return f"after #{s.completed}"


def analyse(dumps: dict[int, RankDump], world_size: int | None = None) -> Diagnosis:
    """Name the stuck collective, the ranks that never entered it or are elsewhere, and
    classify (see :class:`Diagnosis`)."""
    world = set(range(world_size)) if world_size else set(dumps)
    missing_dumps = sorted(world - set(dumps))
    hosts = {r: d.host for r, d in dumps.items()}
    stacks = aggregate_stacks({r: d.stack for r, d in dumps.items() if d.stack})
    frames = _frame_groups(dumps)
    pg = _pick_pg(dumps)
    states = {r: d.state(pg) for r, d in dumps.items()} if pg else {}
    known = {r: s for r, s in states.items() if s is not None}
    unknown = sorted(set(dumps) - set(known))
    groups_by: dict[tuple[str | None, int, int], list[int]] = defaultdict(list)
    for r, s in known.items():
        groups_by[(s.op if s.in_flight else None, s.entered, s.completed)].append(r)
    groups = [
        {
            "pg": pg,
            "op": op,
            "entered": entered,
            "completed": completed,
            "in_flight": entered > completed,
            "ranks": sorted(rs),
            "hosts": sorted({hosts[r] for r in rs}),
        }
        for (op, entered, completed), rs in sorted(groups_by.items(), key=lambda kv: kv[1][0])
    ]
    base: dict[str, Any] = {
        "pg": pg,
        "groups": groups,
        "frames": frames,
        "stacks": stacks,
        "missing_dumps": missing_dumps,
    }
    # a rank known only from its progress record (stopped, silent) is at least where the record
    # says, maybe further: never "in another collective", at most "not with the others"
    flying = {
        r: s for r, s in known.items() if s.in_flight and dumps[r].source == "flight_recorder"
    }
    if not flying:
        msg = "no rank is inside a collective" + (
            f" (no trace from ranks {_fmt_ranks(unknown + missing_dumps)})"
            if unknown or missing_dumps
            else ""
        )
        return Diagnosis("unknown", msg, **base)
    by_coll: dict[tuple[str | None, int], list[int]] = defaultdict(list)
    for r, s in flying.items():
        by_coll[(s.op, s.entered)].append(r)
    # the collective most ranks wait in (ties: the newest)
    (op, seq), waiting = max(by_coll.items(), key=lambda kv: (len(kv[1]), kv[0][1]))
    absent = sorted(set(world) - set(flying) - set(unknown) - set(missing_dumps))
    absent += unknown + missing_dumps
    absent = sorted(set(absent))
    if len(by_coll) > 1:
        split = _split_point(
            {r: s for r, s in known.items() if dumps[r].source == "flight_recorder"}
        )
        if split is not None:
            seq, by_op = split
            op, waiting = max(by_op.items(), key=lambda kv: (len(kv[1]), kv[0]))
            parts = [
                f"{_fmt_ranks(rs)} in {o} #{seq}"
                for o, rs in sorted(by_op.items(), key=lambda kv: (-len(kv[1]), kv[0]))
            ]
            others = sorted(r for o, rs in by_op.items() if o != op for r in rs)
            past = sorted(r for r in flying if flying[r].entered > seq)
        else:  # no common history: each rank where it waits
            parts = [
                f"{_fmt_ranks(rs)} in {o or 'collective'} #{q}"
                for (o, q), rs in sorted(by_coll.items(), key=lambda kv: (-len(kv[1]), kv[0][1]))
            ]
            others = sorted(set(flying) - set(waiting))
            past = []
        msg = "ranks split: " + ", ".join(parts) + " (divergent code path)"
        if past:
            msg += "; " + ", ".join(
                f"rank {r} got past it, now in {flying[r].op or 'collective'} #{flying[r].entered}"
                for r in past
            )
        if absent:
            msg += f"; ranks {_fmt_ranks(absent)} in no collective"
        return Diagnosis(
            "divergent",
            msg,
            op=op,
            seq=seq,
            suspect_ranks=others,
            suspect_hosts=sorted({hosts[r] for r in others}),
            **base,
        )
    if absent:
        where = ", ".join(
            f"rank {r} on {hosts.get(r, '?')}"
            + (f" ({_where(known[r], dumps[r].source)})" if r in known else "")
            + (" (process stopped)" if r in dumps and dumps[r].process_state == "T" else "")
            for r in absent
        )
        msg = (
            f"stuck in {op or 'collective'} #{seq} (pg {pg}): {where} never entered it; "
            f"ranks {_fmt_ranks(waiting)} wait in it"
        )
        return Diagnosis(
            "missing",
            msg,
            op=op,
            seq=seq,
            suspect_ranks=absent,
            suspect_hosts=sorted({hosts.get(r, "?") for r in absent}),
            **base,
        )
    msg = (
        f"stuck in {op or 'collective'} #{seq} (pg {pg}): every rank entered it, none completed "
        "(transport or peer problem)"
    )
    return Diagnosis("transport", msg, op=op, seq=seq, **base)


def _split_point(states: dict[int, CollectiveState]) -> tuple[int, dict[str, list[int]]] | None:
    """The first collective (sequence id) the ranks' traces disagree on, with the ranks per
    operation there. Past a divergence sequence ids stop naming the same call: a rank may
    finish a collective whose partners never called it (a broadcast's root sends and goes
    on) and wait in the next one; the op each rank ran at the first disagreement is the path
    it took."""
    paths: dict[int, dict[int, str]] = {}
    for r, s in states.items():
        path = {int(q): str(o) for q, o in s.history}
        if s.op and s.entered >= 0:
            path[s.entered] = s.op
        paths[r] = path
    for seq in sorted({q for p in paths.values() for q in p}):
        by_op: dict[str, list[int]] = defaultdict(list)
        for r, p in paths.items():
            if seq in p:
                by_op[p[seq]].append(r)
        if len(by_op) > 1:
            return seq, {o: sorted(rs) for o, rs in by_op.items()}
    return None


def _frame_groups(dumps: dict[int, RankDump]) -> list[dict[str, Any]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for r, d in dumps.items():
        if d.stack:
            groups[main_frame(d.stack) or "?"].append(r)
    return [
        {"frame": f, "ranks": sorted(rs)}
        for f, rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    ]
