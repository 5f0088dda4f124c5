"""Where a hung job is stuck: every rank's last collective and Python stacks, analysed.

On a hang verdict (or when another node's agent announces one in the rendezvous store) the
agent asks its live workers for a dump through a request file the workers' collective watcher
polls (:mod:`trainguard.core.collectives`): each writes its flight-recorder trace and all
threads' stacks into ``<run_dir>/hangs/<attempt>/``. Frozen (stopped) ranks cannot answer: their
stacks come from py-spy and their position from their last collective progress record. Each
agent publishes a compact summary per local rank in the rendezvous store; every agent waits (a
bounded time) for all ranks' summaries, then analyses them (:func:`analyse`) before anything is
killed. Nothing goes through the stuck collectives.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.core.atomicfile import write_atomic
from trainguard.core.collectives import CollectiveState, parse_trace

__all__ = ["Diagnosis", "RankDump", "aggregate_stacks", "analyse", "local_stacks", "main_frame"]

logger = logging.getLogger(__name__)

STORE_PREFIX = "trainguard/hang"


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


# -- stacks -----------------------------------------------------------------------------------
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_PYSPY_HEADER = re.compile(r"^(Process \d+:|Python v|# rank )")
_THREAD_ID = re.compile(r"^(Thread) \d+(?= )")


def _normalise(stack: str) -> str:
    lines = []
    for line in stack.splitlines():
        if _PYSPY_HEADER.match(line) or not line.strip():
            continue
        line = _THREAD_ID.sub(r"\1", _HEX.sub("0x?", line))
        lines.append(line.rstrip())
    return "\n".join(lines)


def aggregate_stacks(stacks: dict[int, str]) -> list[dict[str, Any]]:
    """Identical stacks (thread ids and addresses aside) → one entry with the rank list,
    largest group first."""
    groups: dict[str, list[int]] = defaultdict(list)
    for r, s in stacks.items():
        groups[_normalise(s)].append(r)
    return [
        {"ranks": sorted(rs), "stack": text}
        for text, rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    ]


_FH_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_PYSPY_FRAME = re.compile(r"^\s+(?P<func>\S+) \((?P<file>[^:()]+):(?P<line>\d+)\)")


_LIBRARY = re.compile(r"[/\\](torch|trainguard|threading\.py)([/\\]|$)|threading\.py$")


def main_frame(stack: str) -> str | None:
    """Innermost frame of the main thread (faulthandler or py-spy text) outside torch and
    trainguard, as ``func (file:line)``: where the user's code called in."""
    lines = stack.splitlines()
    for i, line in enumerate(lines):
        is_main = ("MainThread" in line) or (
            line.startswith(("Thread 0x", "Current thread 0x")) and i == _last_thread_header(lines)
        )
        if not is_main:
            continue
        for frame in lines[i + 1 :]:
            m = _FH_FRAME.match(frame) or _PYSPY_FRAME.match(frame)
            if m and not _LIBRARY.search(m["file"]):
                return f"{m['func']} ({Path(m['file']).name}:{m['line']})"
            if not frame.strip():
                break
    return None


def _last_thread_header(lines: list[str]) -> int:
    """faulthandler lists the main thread last."""
    idx = [i for i, ln in enumerate(lines) if ln.startswith(("Thread 0x", "Current thread 0x"))]
    return idx[-1] if idx else -1


def _frame_groups(dumps: dict[int, RankDump]) -> list[dict[str, Any]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for r, d in dumps.items():
        if d.stack:
            groups[main_frame(d.stack) or "?"].append(r)
    return [
        {"frame": f, "ranks": sorted(rs)}
        for f, rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    ]


# -- collection (agent side) ------------------------------------------------------------------
def wait_for_files(paths: dict[int, Path], deadline: float) -> dict[int, Path]:
    """The files of ``paths`` that exist by ``deadline`` (monotonic)."""
    while True:
        got = {r: p for r, p in paths.items() if p.exists()}
        if len(got) == len(paths) or time.monotonic() >= deadline:
            return got
        time.sleep(0.05)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        logger.warning("cannot read %s: %s", path, e)
        return None


def _local_dump(
    rank: int, host: str, d: Path, pstate: str | None, progress_dir: str | None
) -> RankDump:
    """This node's rank: its answer to the dump request, else its collective progress record."""
    from trainguard.core.collectives import collective_progress_path
    from trainguard.core.progress import ProgressReader

    trace = read_json(d / f"fr_rank_{rank}.json") if (d / f"fr_rank_{rank}.json").exists() else None
    stack = ""
    for name in (f"stacks_rank_{rank}.txt", f"pyspy_rank_{rank}.txt"):
        try:
            stack = (d / name).read_text(encoding="utf-8")
            break
        except OSError:
            continue
    if trace is not None:
        return RankDump.from_trace(rank, host, trace, stack=stack, process_state=pstate)
    snap = None
    if progress_dir:
        snap = ProgressReader(progress_dir).read_path(collective_progress_path(progress_dir, rank))
    if snap is None:
        return RankDump(rank, host, "none", stack=stack, process_state=pstate)
    entered = snap.step + 1 if snap.in_step else snap.step
    pg = "0:default_pg"
    state = CollectiveState(pg, entered, snap.step)
    return RankDump(rank, host, "progress", {pg: state.to_json()}, stack, pstate)


def local_stacks(directory: Path, ranks: list[int]) -> dict[int, dict[str, str]]:
    """The stacks the diagnosis took of this node's ranks (the worker's own faulthandler dump,
    py-spy for a stopped one), in :func:`trainguard.health.stacks.dump_stacks`'s layout."""
    out: dict[int, dict[str, str]] = {}
    for r in ranks:
        for name, method in (
            (f"stacks_rank_{r}.txt", "faulthandler"),
            (f"pyspy_rank_{r}.txt", "py-spy"),
        ):
            path = directory / name
            try:
                out[r] = {
                    "method": method,
                    "path": str(path),
                    "stack": path.read_text(encoding="utf-8"),
                }
                break
            except OSError:
                continue
    return out


def collect_and_analyse(
    ctx: Any,
    pids: dict[int, int],
    *,
    frozen: set[int],
    world_size: int,
    timeout_s: float,
    store_key: str,
    process_state: Callable[[int], str | None],
) -> Diagnosis:
    """Ask this node's live ranks for a dump (request file), take frozen ranks' stacks with
    py-spy, publish every local rank's summary in the rendezvous store, wait (bounded) for every
    rank of the job, analyse and write ``diagnosis.json``. ``ctx`` is the AgentContext."""
    import os

    from trainguard.core import envvars
    from trainguard.core.collectives import hang_dir, request_dir_ok, request_path
    from trainguard.health.stacks import dump_stacks

    deadline = time.monotonic() + timeout_s
    node = ctx.events.node
    d = hang_dir(ctx.run_dir, max(ctx.attempt, 0))
    d.mkdir(parents=True, exist_ok=True)
    if not request_dir_ok(ctx.run_dir, d):
        raise OSError(f"{d} is a symlink or not this user's directory; no hang dump written")
    req = request_path(d, node)
    write_atomic(req, json.dumps({"node": node, "time": time.time()}))
    store = ctx.store
    if store is not None:
        try:
            store.set(store_key, node)
        except Exception as e:
            logger.warning("cannot announce the hang in the rendezvous store: %s", e)
    stopped = {r for r, p in pids.items() if r in frozen or process_state(p) == "T"}
    if stopped:  # py-spy reads a stopped process without continuing it
        got = dump_stacks(
            {r: pids[r] for r in stopped},
            run_dir=ctx.run_dir,
            attempt=max(ctx.attempt, 0),
            timeout_s=max(0.5, min(3.0, deadline - time.monotonic())),
        )
        for r, s in got.items():
            if s["method"] != "none":
                write_atomic(d / f"pyspy_rank_{r}.txt", s["stack"])
    live = {r: d / f"fr_rank_{r}.json" for r in pids if r not in stopped}
    wait_for_files(live, time.monotonic() + max(0.5, (deadline - time.monotonic()) / 2))
    req.unlink(missing_ok=True)
    progress_dir = os.environ.get(envvars.PROGRESS_DIR)
    local = {r: _local_dump(r, node, d, process_state(pids[r]), progress_dir) for r in pids}
    dumps = dict(local)
    if store is not None and world_size > len(local):
        dumps.update(_exchange(store, store_key, local, world_size, deadline))
    for r, rd in local.items():
        write_atomic(d / f"summary_rank_{r}.json", json.dumps(rd.to_json()))
    diag = analyse(dumps, world_size)
    write_atomic(d / "diagnosis.json", json.dumps(diag.to_json(), indent=1))
    return diag


def _exchange(
    store: Any, key: str, local: dict[int, RankDump], world_size: int, deadline: float
) -> dict[int, RankDump]:
    for r, rd in local.items():
        try:
            store.set(f"{key}/rank/{r}", json.dumps(rd.to_json()))
        except Exception as e:
            logger.warning("cannot publish rank %d's hang summary: %s", r, e)
    out: dict[int, RankDump] = {}
    todo = [r for r in range(world_size) if r not in local]
    while todo:
        for r in list(todo):
            k = f"{key}/rank/{r}"
            try:
                if store.check([k]):
                    out[r] = RankDump.from_json(json.loads(store.get(k)))
                    todo.remove(r)
            except Exception as e:
                logger.debug("rank %d's hang summary unreadable: %s", r, e)
        if not todo or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return out
