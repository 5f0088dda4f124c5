"""The agent's side of a hang diagnosis: ask, wait, read, exchange, write the verdict.

On a hang verdict (or when another node's agent announces one in the rendezvous store) the
agent asks its live workers for a dump through a request file in the attempt's dump directory
(:meth:`trainguard.core.contracts.rundir.RunDir.hang`), which the workers' flight-recorder watcher polls
(:mod:`trainguard.core.flight_recorder`): each writes its flight-recorder trace and all threads'
stacks there. Frozen (stopped) ranks cannot answer: their stacks come from py-spy and their
position from their last collective progress record. Each agent publishes a compact summary per
local rank in the rendezvous store; every agent waits (a bounded time) for all ranks' summaries,
then analyses them (:func:`trainguard.health.hangdiag.analyse`) before anything is killed.
Nothing goes through the stuck collectives.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.core.atomicfile import make_dirs, write_atomic
from trainguard.core.contracts.rundir import DumpDir, RunDir
from trainguard.core.flight_recorder import CollectiveState
from trainguard.health.hangdiag import Diagnosis, RankDump, analyse

if TYPE_CHECKING:
    from torch.distributed import Store

    from trainguard.core.plugin import AgentContext

__all__ = ["collect_and_analyse", "local_stacks", "read_json", "wait_for_files"]

logger = logging.getLogger(__name__)


def wait_for_files(paths: dict[int, Path], deadline: float) -> dict[int, Path]:
    """The files of ``paths`` that exist by ``deadline`` (monotonic)."""
    while True:
        got = {r: p for r, p in paths.items() if p.exists()}
        if len(got) == len(paths) or time.monotonic() >= deadline:
            return got
        time.sleep(0.05)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        got: dict[str, Any] | None = json.loads(path.read_text(encoding="utf-8"))
        return got
    except (OSError, ValueError) as e:
        logger.warning("cannot read %s: %s", path, e)
        return None


def _local_dump(
    rank: int, host: str, d: DumpDir, pstate: str | None, progress_dir: str | None
) -> RankDump:
    """This node's rank: its answer to the dump request, else its collective progress record."""
    from trainguard.core.flight_recorder import collective_progress_path
    from trainguard.core.progress import ProgressReader

    trace = read_json(d.fr_trace(rank)) if d.fr_trace(rank).exists() else None
    stack = ""
    for path, _method in d.stack_files(rank):
        try:
            stack = path.read_text(encoding="utf-8")
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


def local_stacks(directory: DumpDir, ranks: list[int]) -> dict[int, dict[str, str]]:
    """The stacks the diagnosis took of this node's ranks (the worker's own faulthandler dump,
    py-spy for a stopped one), in :func:`trainguard.health.stacks.dump_stacks`'s layout."""
    out: dict[int, dict[str, str]] = {}
    for r in ranks:
        for path, method in directory.stack_files(r):
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
    ctx: AgentContext,
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

    from trainguard.core.contracts import envvars
    from trainguard.health.stacks import dump_stacks

    deadline = time.monotonic() + timeout_s
    node = ctx.events.node
    d = RunDir(ctx.run_dir).hang(max(ctx.attempt, 0))
    make_dirs(d.path)
    if not RunDir(ctx.run_dir).dump_dir_ok(d.path):
        raise OSError(f"{d.path} is a symlink or not this user's directory; no hang dump written")
    req = d.request(node)
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
                write_atomic(d.pyspy_stacks(r), s["stack"])
    live = {r: d.fr_trace(r) for r in pids if r not in stopped}
    wait_for_files(live, time.monotonic() + max(0.5, (deadline - time.monotonic()) / 2))
    req.unlink(missing_ok=True)
    progress_dir = os.environ.get(envvars.PROGRESS_DIR)
    local = {r: _local_dump(r, node, d, process_state(pids[r]), progress_dir) for r in pids}
    dumps = dict(local)
    if store is not None and world_size > len(local):
        dumps.update(_exchange(store, store_key, local, world_size, deadline))
    for r, rd in local.items():
        write_atomic(d.summary(r), json.dumps(rd.to_json()))
    diag = analyse(dumps, world_size)
    write_atomic(d.diagnosis, json.dumps(diag.to_json(), indent=1))
    return diag


def _exchange(
    store: Store, key: str, local: dict[int, RankDump], world_size: int, deadline: float
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
