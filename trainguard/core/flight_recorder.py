"""The flight-recorder watcher: a worker's collective progress, read from torch's flight recorder
(the one place trainguard reads it; torch is imported lazily, inside the worker), and its
answers to hang-dump requests.

torch records every collective a process group issues (gloo and NCCL alike) in a ring buffer
when ``TORCH_FR_BUFFER_SIZE`` is set before the group is created. Per process group the
recorder keeps the sequence id of the last collective *enqueued* and the last *completed*;
reading that status costs a few microseconds.

In the worker, :func:`start_in_worker` (a worker start-up hook entry the agent's hang detector
declares, run before the user's script) starts a daemon thread that waits
for the default process group, then every ``interval`` writes the newest completed collective
of the default group into the rank's *collective progress record* (same layout as the
``tg.step()`` record, :mod:`trainguard.core.progress`): ``step`` = last completed sequence id,
"in step" = a collective is in flight (enqueued, not completed), ``last_step_s`` = time between
completions. The agent judges a rank that never calls ``tg.step()`` by this record. The same
thread answers the agent's dump requests (a file, :meth:`trainguard.core.contracts.rundir.DumpDir.request`):
it writes the full flight-recorder trace and all threads' Python stacks of its process into the
dump directory (``RunDir.hang`` or ``RunDir.debug``),
never touching the (possibly stuck) collectives.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.core.atomicfile import atomic_open, make_dirs, open_append, write_atomic
from trainguard.core.contracts import envvars
from trainguard.core.contracts.rundir import DumpDir, RunDir
from trainguard.core.progress import ProgressWriter

__all__ = [
    "FR_BUFFER_ENV",
    "WORKER_HOOK",
    "CollectiveState",
    "collective_progress_path",
    "dump_trace",
    "parse_trace",
    "start_in_worker",
]

logger = logging.getLogger(__name__)

FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
"""torch's switch for its flight recorder (entries kept per process)."""
FR_BUFFER_DEFAULT = 2000
"""The watcher puts it (unless the user set it) into the worker's C environment only
(``os.putenv``), where torch reads it, so the script's ``os.environ`` stays exactly what
torchrun would give it."""
REQUEST_POLL_S = 0.5
"""How often a worker looks for a dump request."""
HISTORY = 16
"""Collectives per process group a rank's summary keeps (:attr:`CollectiveState.history`)."""
WORKER_HOOK = "trainguard.core.flight_recorder:start_in_worker"
"""The worker start-up hook entry that starts the watcher (:func:`start_in_worker`)."""


def collective_progress_path(progress_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(progress_dir) / f"collectives_rank_{rank}.bin"


# -- reading torch's flight recorder (the only torch-private access of trainguard's FR use) --
def _dump_json(include_collectives: bool) -> bytes:
    from trainguard.core._torch import dump_fr_trace_json

    return dump_fr_trace_json(include_collectives)


def dump_trace() -> dict[str, Any] | None:
    """This process's full flight-recorder trace (JSON-decoded); None when unavailable."""
    try:
        return json.loads(_dump_json(True))
    except Exception as e:  # no recorder in this build, not initialised...
        logger.debug("no flight-recorder trace: %s", e)
        return None


def _default_pg_status() -> tuple[int, int] | None:
    """(last enqueued, last completed) sequence ids of the default process group."""
    status = json.loads(_dump_json(False)).get("pg_status", {})
    st = status.get("0")
    if st is None:
        return None
    return int(st["last_enqueued_collective"]), int(st["last_completed_collective"])


@dataclass(slots=True)
class CollectiveState:
    """One rank's position in one process group, from its trace."""

    pg: str
    """Process group id (``0`` is the default group) and name, e.g. ``0:default_pg``."""
    entered: int
    """Sequence id of the last collective enqueued (-1: none)."""
    completed: int
    """Sequence id of the last collective completed (-1: none)."""
    op: str | None = None
    """Operation of the last collective entered, e.g. ``all_reduce`` (no backend prefix)."""
    sizes: list[Any] = field(default_factory=list)
    """Input sizes of the last collective entered."""
    history: list[list[Any]] = field(default_factory=list)
    """The newest collectives entered (up to :data:`HISTORY`), oldest first: ``[seq, op]``.
    Once ranks took different paths their sequence ids no longer name the same call (a rank
    can finish a collective against the wrong partner and go on): the history shows where
    each rank's path parted from the others'."""

    @property
    def in_flight(self) -> bool:
        return self.entered > self.completed

    def to_json(self) -> dict[str, Any]:
        return {
            "pg": self.pg,
            "entered": self.entered,
            "completed": self.completed,
            "op": self.op,
            "sizes": self.sizes,
            "history": self.history,
        }


def _op_name(profiling_name: str) -> str:
    return profiling_name.split(":", 1)[-1] if profiling_name else "?"


def parse_trace(trace: dict[str, Any]) -> dict[str, CollectiveState]:
    """Per process group (id:name): the last collective entered and completed, with the op and
    sizes of the last one entered. Only collectives (p2p entries are skipped)."""
    names: dict[str, str] = {}
    last_entry: dict[str, dict[str, Any]] = {}
    ops: dict[str, dict[int, str]] = {}
    for e in trace.get("entries", []):
        if e.get("is_p2p"):
            continue
        pg_id, pg_name = (list(e.get("process_group") or ["?", "?"]) + ["?"])[:2]
        names[str(pg_id)] = str(pg_name)
        seq = e.get("collective_seq_id")
        if isinstance(seq, int):
            ops.setdefault(str(pg_id), {})[seq] = _op_name(e.get("profiling_name", ""))
        prev = last_entry.get(str(pg_id))
        if prev is None or e.get("collective_seq_id", -1) >= prev.get("collective_seq_id", -1):
            last_entry[str(pg_id)] = e
    out: dict[str, CollectiveState] = {}
    for pg_id, st in (trace.get("pg_status") or {}).items():
        entered = int(st.get("last_enqueued_collective", -1))
        completed = int(st.get("last_completed_collective", -1))
        e = last_entry.get(pg_id)
        op = sizes = None
        if e is not None and e.get("collective_seq_id") == entered:
            op, sizes = _op_name(e.get("profiling_name", "")), e.get("input_sizes") or []
        key = f"{pg_id}:{names.get(pg_id, 'default_pg' if pg_id == '0' else '?')}"
        hist = sorted(ops.get(pg_id, {}).items())[-HISTORY:]
        out[key] = CollectiveState(
            key, entered, completed, op, sizes or [], [[q, o] for q, o in hist]
        )
    return out


# -- the in-worker watcher --------------------------------------------------------------------
def _fr_on_by_default() -> bool:
    """Whether the installed torch records collectives without :data:`FR_BUFFER_ENV` (its
    default buffer is 2000 entries from torch 2.11 on; 0, off, before). Read from the package
    metadata: torch is not imported here."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("torch").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (2, 11)


class _Watcher:
    def __init__(self, interval_s: float, *, unset_fr: bool = False) -> None:
        self.interval_s = interval_s
        self.unset_fr = unset_fr
        self.rank = int(os.environ.get("RANK", "0"))
        self.run_dir = os.environ.get(envvars.RUN_DIR)
        self.progress_dir = os.environ.get(envvars.PROGRESS_DIR)
        self.attempt = int(os.environ.get(envvars.ATTEMPT, "0") or 0)
        self.writer: ProgressWriter | None = None
        self._answered: set[str] = set()
        self._next_request_check = 0.0
        self._fh_file: Any = None
        # the watcher thread and the exit hook may both finish the record: the exit hook waits
        # for the other's close, else the interpreter ends before "finishing" is written
        self._finish_lock = threading.Lock()

    def _dist_ready(self) -> bool:
        dist = sys.modules.get("torch.distributed")
        try:
            return bool(dist is not None and dist.is_available() and dist.is_initialized())
        except Exception:
            return False

    def run(self) -> None:
        while not self._dist_ready():
            self._answer_requests()
            time.sleep(self.interval_s)
        self._register_stack_signal()
        if self.unset_fr:  # the script's children never inherit the size set for torch:
            try:  # a dump creates torch's recorder (reading the size) if the group did not
                _dump_json(False)
            except Exception as e:
                logger.debug("no flight recorder: %s", e)
            os.unsetenv(FR_BUFFER_ENV)
        from trainguard.core.config import worker_section_or_default

        # settings reach a worker one way, the run's config.json; never stops the worker
        hb = worker_section_or_default(self.run_dir, "runtime").heartbeat_interval_s
        if self.progress_dir:
            self.writer = ProgressWriter(
                collective_progress_path(self.progress_dir, self.rank), heartbeat_interval_s=hb
            )
            # interpreter shutdown stops daemon threads (the heartbeat) while the process may
            # still take seconds to exit: a closed record reads as "finishing", not "frozen"
            atexit.register(self._finish)
        last_completed, last_change = -1, time.time()
        in_flight_since = 0.0
        while True:
            ready = self._dist_ready()
            if not ready and self.writer is not None:  # the script destroyed its group
                self._finish()
            try:
                status = _default_pg_status() if ready else None
            except Exception as e:  # never into training: stop watching, leave a trace
                logger.warning("trainguard: collective progress unavailable: %s", e)
                return
            writer = self.writer
            if status is not None and writer is not None:
                entered, completed = status
                now = time.time()
                try:
                    if completed != last_completed:
                        writer.step_end(completed, now - last_change)
                        last_completed, last_change, in_flight_since = completed, now, 0.0
                    if entered > completed and not in_flight_since:
                        in_flight_since = now
                        writer.step_begin(completed)
                except ValueError:  # closed at exit meanwhile
                    return
            self._answer_requests()
            time.sleep(self.interval_s)

    def _register_stack_signal(self) -> None:
        """The agent's fallback stack dump (no py-spy) signals the worker with SIGUSR2
        (trainguard.health.stacks); a script that never called ``trainguard.init()`` gets the
        same faulthandler file here, unless it handles the signal itself."""
        import signal

        if not self.run_dir or signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, None):
            return
        path = RunDir(self.run_dir).signal_stacks(self.attempt, self.rank)
        try:
            make_dirs(path.parent)
            fd = open_append(path)
            f = os.fdopen(fd, "a", encoding="utf-8")
            self._fh_file = f  # kept open: faulthandler writes to its descriptor
            faulthandler.register(signal.SIGUSR2, file=f, all_threads=True, chain=False)
        except (OSError, ValueError, RuntimeError) as e:
            logger.warning("trainguard: no stack dump signal: %s", e)

    def _finish(self) -> None:
        """The group is gone or the interpreter exits: the record says "not in a collective"
        and "finishing" (an endless heartbeat), never "stuck" nor "frozen"."""
        with self._finish_lock:
            writer, self.writer = self.writer, None
            if writer is not None:
                try:
                    writer.idle()
                except ValueError:  # already unmapped
                    pass
                writer.close()

    def _answer_requests(self) -> None:
        """Dump on request: the flight-recorder trace and every thread's stack, as files.
        Looked for at most every :data:`REQUEST_POLL_S` (a directory listing in the run
        directory, which may be on a shared file system)."""
        now = time.monotonic()
        if not self.run_dir or now < self._next_request_check:
            return
        self._next_request_check = now + REQUEST_POLL_S
        run_dir = RunDir(self.run_dir)
        for req in run_dir.dump_requests(self.attempt):
            key = str(req)
            if key in self._answered:
                continue
            self._answered.add(key)
            if not run_dir.dump_dir_ok(req.parent):
                logger.warning(
                    "trainguard: ignored the dump request %s: its directory is a symlink or "
                    "not this user's",
                    req,
                )
                continue
            dump_rank(req.parent, self.rank)


def dump_rank(directory: Path, rank: int) -> None:
    """Answer a dump request in ``directory`` (a :class:`~trainguard.core.contracts.rundir.DumpDir`):
    this process's stacks, then its flight-recorder trace (the file the asker waits for), each
    through an exclusive temporary file (never through a symlink planted at either name)."""
    d = DumpDir(directory)
    try:
        with atomic_open(d.stacks(rank)) as f:
            faulthandler.dump_traceback(f, all_threads=True)
        trace = dump_trace() or {}
        trace["trainguard"] = {
            "rank": rank,
            "pid": os.getpid(),
            "time": time.time(),
            "host": os.environ.get(envvars.NODE, ""),
        }
        write_atomic(d.fr_trace(rank), json.dumps(trace))
    except Exception as e:
        logger.warning("trainguard: cannot write the hang dump of rank %d: %s", rank, e)


def start_in_worker() -> threading.Thread | None:
    """The worker start-up hook entry (:data:`WORKER_HOOK`, declared by the agent's hang
    detector): switch torch's flight recorder on (in the C environment only, unless the user
    set its size) and start the watcher thread, reading every
    ``[health] collective_poll_interval_s`` from the run's ``config.json``. Outside
    ``trainguard run`` (no run directory) it does nothing."""
    if not os.environ.get(envvars.PROGRESS_DIR):
        return None
    # torch's getenv sees it, os.environ does not; removed again once the recorder exists
    set_fr = FR_BUFFER_ENV not in os.environ and not _fr_on_by_default()
    if set_fr:
        os.putenv(FR_BUFFER_ENV, str(FR_BUFFER_DEFAULT))
    from trainguard.core.config import worker_section_or_default

    interval = worker_section_or_default(
        os.environ.get(envvars.RUN_DIR), "health"
    ).collective_poll_interval_s
    watcher = _Watcher(float(interval), unset_fr=set_fr)
    t = threading.Thread(target=watcher.run, name="trainguard-collectives", daemon=True)
    t.start()
    return t
