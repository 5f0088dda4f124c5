"""The persister process (``persist_mode = "process"``): one per rank, started by the worker's
checkpoint manager, writing checkpoints so that serialisation, checksumming and the write
syscalls never hold the training process's GIL.

Zero copy: the staged slots are files in shared memory (the node's memory tier, or a private
directory in ``/dev/shm``); the persister maps the slot it is asked to write, builds tensor
views over it and hands them to DCP. The persisters of all ranks form their own gloo group
through the job's store (``MASTER_ADDR:MASTER_PORT``, a key prefix per generation), so their
collectives never touch the training process group.

Protocol, one JSON line each way over the child's stdin/stdout (the child's own prints go to
stderr): first the parent's ``init``; the child answers ``{"ready": true}``; then per save
``{"step", "bin_path", "nbytes", "entries", "skeleton"}`` → ``{"committed", "error"}``.
A dead child (kill -9, OOM) is an EOF: that save fails, and the manager replaces the
persisters of every rank before the next save (see ``CheckpointManager.maybe_save``).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import select
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from trainguard.checkpoint.ownerlock import hold_owner_lock, orphaned
from trainguard.core.contracts import envvars

if TYPE_CHECKING:
    from trainguard.core.config.checkpoint import CheckpointConfig

__all__ = [
    "AUTO_PROCESS_MIN_BYTES",
    "PRIVATE_DIR_PREFIX",
    "PersisterProcess",
    "main",
    "private_staging_dir",
    "sweep_private_dirs",
    "unusable_reason",
    "usable",
]

AUTO_PROCESS_MIN_BYTES = 64 << 20
"""``persist_mode = "auto"``: the state per rank from which saves persist in a persister
process (where one can run); smaller states persist in the worker's thread."""

PRIVATE_DIR_PREFIX = "trainguard-persist-"
"""``<memory_root>/trainguard-persist-<worker pid>-<random>``: process mode's staging slots when
the node has no memory tier."""


def sweep_private_dirs(root: str) -> list[str]:
    """Remove private staging directories whose worker is gone (kill -9 of worker and
    persister together); returns what was removed."""
    import shutil

    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:  # gone: its owner lock is free (works across PID namespaces)
        if name.startswith(PRIVATE_DIR_PREFIX) and orphaned(Path(root) / name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


def unusable_reason(config: CheckpointConfig, world_size: int, fs_factory: Any) -> str | None:
    """Why process mode cannot work for this worker (None: it can)."""
    if fs_factory is not None:
        return "a filesystem factory was given (it cannot cross into another process)"
    if world_size > 1 and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return "MASTER_ADDR/MASTER_PORT are not set (the persisters meet through that store)"
    if not os.path.isdir(config.memory_root):
        return f"{config.memory_root} does not exist"
    if not os.access(config.memory_root, os.W_OK | os.X_OK):
        return f"{config.memory_root} is not writable"
    return None


_logged_choices: set[tuple[str, str, str | None]] = set()


def usable(config: CheckpointConfig, world_size: int, fs_factory: Any) -> bool:
    """Whether this worker persists in a persister process (``persist_mode`` ``process`` or
    ``auto``) or in a thread; the choice is logged once per process (a warning where
    ``process`` was asked for and cannot be had)."""
    why = unusable_reason(config, world_size, fs_factory)
    key = (config.persist_mode, "thread" if why else "process", why)
    if key not in _logged_choices:
        _logged_choices.add(key)
        if why is None and config.persist_mode == "auto":
            logger.info(
                "checkpoint persist_mode=auto: persisting in a persister process per rank "
                "(a state of %d MiB or more per rank; a smaller one in a thread)",
                AUTO_PROCESS_MIN_BYTES >> 20,
            )
        elif why is None:
            logger.info("checkpoint persist_mode=process: persisting in a persister process")
        elif config.persist_mode == "process":
            logger.warning("persist_mode=process unavailable: %s; persisting in a thread", why)
        else:
            logger.info(
                "checkpoint persist_mode=%s: persisting in a thread (%s)", config.persist_mode, why
            )
    return why is None


def private_staging_dir(root: str) -> tuple[Path, int]:
    """A new private staging directory for this worker under ``root`` (after sweeping those
    of dead workers), and the fd of its owner lock: keep it open while the directory is used."""
    import tempfile

    sweep_private_dirs(root)
    d = Path(tempfile.mkdtemp(prefix=f"{PRIVATE_DIR_PREFIX}{os.getpid()}-", dir=root))
    return d, hold_owner_lock(d)


logger = logging.getLogger(__name__)


START_S = 300.0
"""Longest wait for a new persister to be ready (it imports torch and joins its group)."""


class PersisterProcess:
    """Parent-side handle of one rank's persister process."""

    def __init__(self, init: dict[str, Any], *, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        """Longest wait for one reply (the start, one persist); then the child is killed and
        the handle broken (``timed_out``)."""
        self.timed_out = False
        self._buf = b""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env[_PARENT_ENV] = str(os.getpid())  # the child watches this PID, not its getppid()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.checkpoint.persist_proc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        self._lock = threading.Lock()
        self._ready = False
        self.broken: str | None = None
        """Why the persister cannot take saves any more (it died, or never started)."""
        self.start_failed = False
        self._send(init)  # the child imports torch and joins its group meanwhile

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check(self) -> str | None:
        """Why this persister cannot take saves (None: it can). Notices a child that died
        between saves, e.g. while applying retention after its last reply."""
        if self.broken is None and self.proc.poll() is not None:
            self.broken = (
                f"persister process {self.proc.pid} died (exit code {self.proc.returncode})"
            )
        return self.broken

    def _send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def _recv(self, timeout_s: float | None) -> dict[str, Any]:
        """The child's next reply line, waiting at most ``timeout_s`` (``TimeoutError``)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()  # read raw: select() must see every byte not yet taken
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            if deadline is not None:
                left = max(deadline - time.monotonic(), 0.0)
                if not select.select([fd], [], [], left)[0]:
                    raise TimeoutError(
                        f"persister process {self.proc.pid} did not answer within {timeout_s:g} s"
                    )
            chunk = os.read(fd, 65536)  # without the GIL
            if not chunk:
                try:
                    code: int | None = self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    code = None
                raise EOFError(f"persister process {self.proc.pid} died (exit code {code})")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def poll_ready(self) -> bool:
        """Whether the persister said it is ready, without waiting (False: not yet, or it
        failed to start: then :attr:`broken` and :attr:`start_failed` say so)."""
        if self._ready:
            return True
        if self.broken is not None or not self._lock.acquire(blocking=False):
            return False
        try:
            reply = self._recv(0.0)
        except TimeoutError:
            return False
        except (OSError, EOFError, ValueError) as e:
            self.broken = str(e)
            return False
        finally:
            self._lock.release()
        if not reply.get("ready"):
            self.start_failed = True
            self.broken = f"persister failed to start: {reply.get('error')}"
            return False
        self._ready = True
        return True

    def persist(self, request: dict[str, Any]) -> tuple[bool, str | None]:
        """Send one save and wait for its outcome; a dead child marks the handle broken."""
        with self._lock:
            if self.broken:
                return False, self.broken
            try:
                if not self._ready:
                    start = None if self.timeout_s is None else max(self.timeout_s, START_S)
                    reply = self._recv(start)
                    if not reply.get("ready"):
                        self.start_failed = True
                        raise EOFError(f"persister failed to start: {reply.get('error')}")
                    self._ready = True
                self._send(request)
                reply = self._recv(self.timeout_s)
            except TimeoutError as e:  # stopped or stuck: it will not answer this save
                self.broken = str(e)
                self.timed_out = True
                self.kill()
                return False, self.broken
            except (OSError, EOFError, ValueError) as e:
                self.broken = str(e)
                return False, self.broken
            return bool(reply.get("committed")), reply.get("error")

    def kill(self) -> None:
        """SIGKILL the child (it may be stuck in a collective with a dead peer) and reap it."""
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass

    def close(self, timeout: float = 30.0) -> None:
        """Ask the child to leave; kill it if it does not."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
            self.proc.wait(timeout)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        self.kill()


# -- the child -----------------------------------------------------------------------------------
def _views(path: str, nbytes: int, entries: list[list[Any]], maps: dict[str, Any]) -> list[Any]:
    from trainguard.checkpoint.staging import Layout, views_of

    mm = maps.get(path)
    if mm is None or len(mm) < nbytes:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), max(nbytes, 1), access=mmap.ACCESS_READ)
        maps[path] = mm
    layout = Layout.from_entries(entries, nbytes)
    with warnings.catch_warnings():  # a read-only mapping; DCP only reads the views
        warnings.simplefilter("ignore", UserWarning)
        return views_of(mm, layout)


def _init_group(init: dict[str, Any]) -> Any:
    if init["world_size"] <= 1:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=init["timeout_s"])
    store: dist.Store = dist.TCPStore(
        init["master_addr"], int(init["master_port"]), is_master=False, timeout=timeout
    )
    store = dist.PrefixStore(init["prefix"], store)
    dist.init_process_group(
        "gloo", store=store, rank=init["rank"], world_size=init["world_size"], timeout=timeout
    )
    return dist.group.WORLD


def _serve(rx: IO[str], tx: IO[str]) -> bool:
    """Serve saves until told to exit (True) or until stdin closes: the worker died (False)."""
    from trainguard.core.procs import pause_gc, resume_gc

    pause_gc()  # torch and DCP import with the collector off; module state, frozen once ready
    from trainguard.checkpoint import jsoncodec
    from trainguard.checkpoint.faults import Faults
    from trainguard.checkpoint.persist import Writer
    from trainguard.checkpoint.staging import unflatten
    from trainguard.checkpoint.storage import storage_for
    from trainguard.core.config.checkpoint import CheckpointConfig

    def reply(**msg: object) -> None:
        tx.write(json.dumps(msg) + "\n")
        tx.flush()

    init = json.loads(rx.readline())
    global _cleanup_dir
    _cleanup_dir = init.get("cleanup_dir")
    try:
        pg = _init_group(init)
        writer = Writer(
            root=init["root"],
            storage=storage_for(init["root"]),
            config=CheckpointConfig(**init["config"]),
            rank=init["rank"],
            world_size=init["world_size"],
            pg=pg,
            faults=Faults.from_env(),
        )
    except Exception as e:  # the parent reports it and falls back to its thread
        resume_gc()
        reply(ready=False, error=f"{type(e).__name__}: {e}")
        return True
    # every byte this process writes is checksummed on its way out (ChecksummingWriter) and
    # verified against the manifest on restore; torch.save's own CRC32 of each zip record is
    # a second pass over the bytes that no reader checks (its loader skips it)
    try:
        import torch.utils.serialization.config as serialization

        serialization.save.compute_crc32 = False
    except (ImportError, AttributeError):  # an older torch: it computes it
        pass
    resume_gc()
    reply(ready=True)
    maps: dict[str, Any] = {}
    for line in rx:
        req = json.loads(line)
        if req.get("op") == "exit":
            return True
        try:
            views = _views(req["bin_path"], req["nbytes"], req["entries"], maps)
            staged = unflatten(jsoncodec.loads(req["skeleton"]), views)
            del views
            committed, error = writer.write_and_commit(
                req["step"], staged, marks=req.get("marks") or {}
            )
            del staged
        except Exception as e:
            logger.exception("persist of step %s failed", req.get("step"))
            committed, error = False, f"{type(e).__name__}: {e}"
        reply(committed=committed, error=error)
        if committed and writer.rank == 0:
            try:
                writer.retention()
            except Exception:
                logger.exception("retention after step %s failed", req.get("step"))
    return False


_cleanup_dir: str | None = None
_PARENT_ENV = envvars.PERSIST_PARENT_PID


def _exit_with_parent(parent: int) -> None:
    """A persister never outlives its worker (kill -9, OOM): it may sit in a collective or a
    store wait with a peer that is gone, and it holds the worker's stderr open. On its way out
    it removes the worker's private staging directory (shared memory nobody else frees)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    if _cleanup_dir:
        import shutil

        shutil.rmtree(_cleanup_dir, ignore_errors=True)
    os._exit(1)


def main() -> None:
    """Entry point of ``python -m trainguard.checkpoint.persist_proc``."""
    # The parent's PID as the parent gave it: a worker killed while this child still imported
    # torch has already been replaced by the subreaper in getppid(), and watching that would
    # keep this orphan (and the worker's stdout/stderr it holds) alive for good.
    parent = int(os.environ.get(_PARENT_ENV) or os.getppid())
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    logging.basicConfig(level=logging.WARNING, format="[tg-persist %(process)d] %(message)s")
    proto_out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed by libraries goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    told_to_exit = False
    try:
        told_to_exit = _serve(sys.stdin, proto_out)
    except (BrokenPipeError, KeyboardInterrupt):
        pass
    if not told_to_exit and _cleanup_dir:  # the worker died: free its shared memory
        import shutil

        shutil.rmtree(_cleanup_dir, ignore_errors=True)
    # stdin closed: the manager is done (or gone). Nothing to flush; leave without tearing
    # down a process group whose peers may already be gone.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
