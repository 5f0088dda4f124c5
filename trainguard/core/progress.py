"""Per-worker progress channel: a small memory-mapped file per rank, no network port.

Layout (little endian, 64 bytes): ``step`` int64, ``step_start`` float64 (wall time the
current step began, 0 when between steps), ``last_step_s`` float64, ``heartbeat`` float64
(wall time, refreshed by a background thread), ``pid`` int64, ``num_steps`` int64,
``step_end`` float64 (wall time the last step finished), ``seq`` int64 (bumped on each write).

The training thread writes ``step``/``step_start``/``step_end`` at step boundaries; a daemon
thread refreshes ``heartbeat``. The agent reads both: a fresh heartbeat with no step progress
means the rank is alive but waiting (e.g. in a collective); a stale heartbeat means the process
itself is frozen (SIGSTOP, a hung C call holding the GIL, a dead node). ``close()`` sets the
heartbeat to +inf: a worker that closed its handle is finishing (interpreter shutdown can take
seconds on a busy host), not frozen; it is judged with the idle timeout.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProgressReader", "ProgressSnapshot", "ProgressWriter", "progress_path"]

_FMT = "<qdddqqdq"
_SIZE = 64
assert struct.calcsize(_FMT) <= _SIZE


def progress_path(progress_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(progress_dir) / f"rank_{rank}.bin"


@dataclass(frozen=True, slots=True)
class ProgressSnapshot:
    rank: int
    step: int
    step_start: float
    last_step_s: float
    heartbeat: float
    pid: int
    num_steps: int
    step_end: float

    @property
    def in_step(self) -> bool:
        return self.step_start > 0.0


class ProgressWriter:
    """Written by a worker. All methods are cheap (a struct pack into shared memory)."""

    def __init__(self, path: str | os.PathLike[str], *, heartbeat_interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # no O_TRUNC: an agent reading the file meanwhile sees the old record or the new one,
        # never a zeroed one (pid 0, heartbeat 0: "frozen since 1970")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            os.ftruncate(fd, _SIZE)
            self._mm = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._lock = threading.Lock()
        self._state = [0, 0.0, 0.0, time.time(), os.getpid(), 0, 0.0, 0]
        self._closed = False
        self._flush()
        self._interval = heartbeat_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="trainguard-heartbeat", daemon=True)
        self._thread.start()

    def _flush(self) -> None:
        if self._closed:  # the closing record ("finishing") is the last one
            raise ValueError("progress record closed")
        self._state[7] += 1
        struct.pack_into(_FMT, self._mm, 0, *self._state)

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                if self._closed:
                    return
                self._state[3] = time.time()
                self._flush()

    def step_begin(self, step: int) -> None:
        with self._lock:
            now = time.time()
            self._state[0] = step
            self._state[1] = now
            self._state[3] = now
            self._flush()

    def step_end(self, step: int, duration_s: float) -> None:
        with self._lock:
            now = time.time()
            self._state[0] = step
            self._state[1] = 0.0
            self._state[2] = duration_s
            self._state[3] = now
            self._state[5] += 1
            self._state[6] = now
            self._flush()

    def idle(self) -> None:
        """Between steps from now on (the step that began is abandoned, not completed)."""
        with self._lock:
            self._state[1] = 0.0
            self._flush()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self._interval)
        with self._lock:  # closed: the process is finishing, not frozen (an endless heartbeat;
            self._state[3] = float("inf")  # hang detection gives it the idle timeout)
            try:
                self._flush()
            except ValueError:  # already unmapped
                pass
            self._closed = True
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass


class ProgressReader:
    """Read by the agent: snapshots of every rank's progress file in a directory."""

    def __init__(self, progress_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(progress_dir)

    def read(self, rank: int) -> ProgressSnapshot | None:
        return self.read_path(progress_path(self.dir, rank), rank)

    def read_path(self, path: Path, rank: int | None = None) -> ProgressSnapshot | None:
        """The record in ``path`` (any file of this layout; ``rank`` defaults to the one in
        the ``..._rank_R.bin`` file name)."""
        if rank is None:
            rank = int(path.stem.rsplit("_", 1)[1])
        try:
            with path.open("rb") as f:
                for _ in range(3):  # a record read while the worker wrote it: read it again
                    f.seek(0)
                    first = f.read(_SIZE)
                    f.seek(0)
                    data = f.read(_SIZE)
                    if data == first:
                        break
        except OSError:
            return None
        if len(data) < struct.calcsize(_FMT):
            return None
        step, start, last, beat, pid, num, end, _seq = struct.unpack_from(_FMT, data)
        if pid == 0:  # created, not written yet: no record (not a frozen rank)
            return None
        return ProgressSnapshot(rank, step, start, last, beat, pid, num, end)

    def read_all(self) -> dict[int, ProgressSnapshot]:
        out: dict[int, ProgressSnapshot] = {}
        if not self.dir.is_dir():
            return out
        for p in self.dir.glob("rank_*.bin"):
            try:
                rank = int(p.stem.split("_", 1)[1])
            except ValueError:
                continue
            snap = self.read(rank)
            if snap is not None:
                out[rank] = snap
        return out
