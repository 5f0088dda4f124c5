"""Warm starts: worker processes started ahead of need, with torch already imported.

A started worker normally pays interpreter start-up and ``import torch`` (1-1.5 s on a CPU;
seconds with ``torch._dynamo``/``torch._inductor``, which the ``DistributedDataParallel``
constructor imports) on the critical path: after every restart, and when a spare takes a dead
node's slot. The :class:`WarmPool` keeps one pre-started process ("zygote") per key (the agent
uses the local rank): a fresh ``python`` started with exactly the worker's command line
(``python -u script.py args...`` or ``python -u -m module args...``) whose start-up hook
(``runtime/_zygote/sitecustomize.py`` → :mod:`trainguard.runtime.workerhook`, first on
``PYTHONPATH``) imports the preload modules
and then blocks on a unix socket. :meth:`WarmPool.spawn` hands a zygote the worker's full
environment, working directory and stdout/stderr descriptors; the hook puts them in place and
returns, and the interpreter runs the script itself, as it would have in a fresh process: same
``sys.argv``, ``sys.path[0]``, ``__main__``, ``-m`` handling, exit codes, uncaught exceptions
(exit 1), signals and error files. Nothing is forked after torch is imported. The zygote is a
child of the agent in its own session, so torch's monitoring and teardown (``poll``,
``killpg``) work on it unchanged.

A zygote is used only when the command line is the same and the environment differs from the
one it started with only in values that are read after start-up (the rank and round values
the agent sets: :data:`DYNAMIC_ENV`, ``TORCHELASTIC_*``, ``TRAINGUARD_*``, and the hook's own
entry on ``PYTHONPATH``); anything else (``PYTHON*``, ``OMP_*``, ``LD_*``, ``TORCH_LOGS``, ...)
falls back to a cold start.

Differences a worker can see (by design): its process is older than the hand-off (start
time), it was started with ``TRAINGUARD_ZYGOTE_*`` and trainguard's hook directory in its
*initial* environment (``/proc/<pid>/environ``; ``os.environ`` is exactly the worker's), the
preload modules are already in ``sys.modules``, they were imported before the script's
directory was put on ``sys.path``, and the objects they allocated are in the garbage
collector's permanent generation (``gc.freeze``: imported with the collector off, never walked
by its full collections).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any, Literal

from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from trainguard.core.contracts import envvars
from trainguard.runtime import _torch
from trainguard.runtime.workerhook import HOOK_DIR, without_hook_dir

__all__ = [
    "DYNAMIC_ENV",
    "HOOK_DIR",
    "PooledSubprocessHandler",
    "WarmPool",
    "WarmProcess",
    "env_compatible",
    "serving_torch_workers",
    "warm_argv_ok",
]

logger = logging.getLogger(__name__)

FD_ENV = envvars.ZYGOTE_FD
PRELOAD_ENV = envvars.ZYGOTE_PRELOAD

DYNAMIC_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "CUDA_VISIBLE_DEVICES",  # read when CUDA initialises, never by ``import torch``
        # set by trainguard's rendezvous wrapper only while the agent waits in a round (when a
        # spare's zygotes are started); read by torch's rendezvous, never by a worker
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    }
)
"""Variables a zygote's environment may differ in from the worker's (with ``TORCHELASTIC_*`` and
``TRAINGUARD_*``): torch and trainguard read them after start-up, not while importing."""
_DYNAMIC_PREFIXES = ("TORCHELASTIC_", envvars.NAMESPACE)

MAX_DEATHS = 3
"""Zygotes of one key that may die before handing off before that key is warmed no more."""


def warm_argv_ok(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is a command line a zygote can run: torchrun's Python forms,
    ``python -u SCRIPT ...`` (a file) and ``python -u -m MODULE ...``. Anything else
    (``--no-python``, other interpreter flags, a directory or zip as script) starts cold."""
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-u":
        return False
    if argv[2] == "-m":
        return len(argv) > 3 and not argv[3].startswith("-")
    return not argv[2].startswith("-") and os.path.isfile(argv[2]) and not _is_zip(argv[2])


def _is_zip(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return True


def env_compatible(started: Mapping[str, str], wanted: Mapping[str, str]) -> list[str]:
    """The variables that keep a zygote started with ``started`` from running a worker with
    ``wanted`` (empty: compatible)."""
    keys = set(started) | set(wanted)
    return sorted(
        k
        for k in keys
        if _value(started, k) != _value(wanted, k)
        and k not in DYNAMIC_ENV
        and not (k.startswith(_DYNAMIC_PREFIXES) and not k.startswith(envvars.ZYGOTE_PREFIX))
    )


def _value(env: Mapping[str, str], key: str) -> str | None:
    if key != "PYTHONPATH":
        return env.get(key)
    return _without_hook(env.get(key))


def _without_hook(pythonpath: str | None) -> str | None:
    """``PYTHONPATH`` without trainguard's hook directory (the agent puts it first for the
    worker start-up hook; the hook takes it off again): None when nothing else is left."""
    return without_hook_dir(pythonpath)


@dataclass
class _Zygote:
    proc: subprocess.Popen[bytes]
    sock: socket.socket
    argv: tuple[str, ...]
    env: dict[str, str]
    ready: bool = False


@dataclass
class WarmProcess:
    """A started worker: ``proc`` is its ``Popen`` (poll, wait, returncode, pid) whether it was
    handed to a zygote (``warm``) or started cold."""

    proc: subprocess.Popen[bytes]
    warm: bool

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the worker's process group (it leads its own session, as torch's do)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class _Slot:
    argv: tuple[str, ...]
    env: dict[str, str]
    since: float
    zygote: _Zygote | None = None
    deaths: int = 0


@dataclass
class WarmPool:
    """One pre-started zygote per key, (re)filled ``prestart_delay_s`` after the key's last
    start (so the zygote does not compete with the starting workers for CPU), or at once for a
    key :meth:`prestart` names (a spare's workers, before its first start). Thread-safe: the
    agent starts workers in its main thread while another thread keeps the pool filled."""

    preload: Sequence[str] = ("torch",)
    prestart_delay_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    _slots: dict[Hashable, _Slot] = field(default_factory=dict, init=False, repr=False)
    _closed: bool = field(default=False, init=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)

    def __post_init__(self) -> None:
        atexit.register(self.close)

    # -- starting workers -----------------------------------------------------------------------
    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        stdout: IO[Any] | int | None = None,
        stderr: IO[Any] | int | None = None,
        key: Hashable = 0,
    ) -> WarmProcess:
        """Start ``argv`` with exactly ``env`` (the full environment) in the current working
        directory, in a new session, with ``stdout``/``stderr`` (files or descriptors; None:
        this process's): from ``key``'s zygote when it can run it, else cold (``Popen``). The
        command becomes ``key``'s template for the next zygote."""
        argv = tuple(str(a) for a in argv)
        env = dict(env)
        with self._lock:
            proc = self._hand_off(key, argv, env, stdout, stderr)
            warm = proc is not None
            if proc is None:
                proc = subprocess.Popen(
                    argv, env=env, stdout=stdout, stderr=stderr, start_new_session=True
                )
            self.remember(argv, env, key=key)
        return WarmProcess(proc=proc, warm=warm)

    def has_zygote(self, key: Hashable = 0) -> bool:
        """``key`` has a pre-started process (ready or still importing)."""
        with self._lock:
            slot = self._slots.get(key)
            return slot is not None and slot.zygote is not None

    def remember(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        key: Hashable = 0,
        now: bool = False,
    ) -> None:
        """Make ``argv``/``env`` ``key``'s template for its next zygote, started
        ``prestart_delay_s`` from now (``now``: at the next :meth:`tick`). Only for a key
        without a zygote (:meth:`has_zygote`), whose process would otherwise be lost track of."""
        argv = tuple(str(a) for a in argv)
        with self._lock:
            slot = self._slots.get(key)
            deaths = slot.deaths if slot is not None and slot.argv == argv else 0
            since = self.clock() - (self.prestart_delay_s if now else 0.0)
            self._slots[key] = _Slot(argv=argv, env=dict(env), since=since, deaths=deaths)

    def prestart(self, argv: Sequence[str], env: Mapping[str, str], *, key: Hashable = 0) -> bool:
        """Have a zygote for ``argv``/``env`` started for ``key`` at the next :meth:`tick`
        (a spare's worker, before its first start), unless ``key`` has one already. True when
        one is due."""
        with self._lock:
            if self._closed or self.has_zygote(key):
                return False
            self.remember(argv, env, key=key, now=True)
            return True

    def _hand_off(
        self,
        key: Hashable,
        argv: tuple[str, ...],
        env: dict[str, str],
        stdout: IO[Any] | int | None,
        stderr: IO[Any] | int | None,
    ) -> subprocess.Popen[bytes] | None:
        slot = self._slots.get(key)
        z = slot.zygote if slot is not None else None
        if z is None or slot is None:
            return None
        slot.zygote = None
        diff = env_compatible(z.env, env)
        blockers = [f"the environment differs in {', '.join(diff)}"] if diff else []
        if z.argv != argv:
            blockers = ["the command line differs"]
        if z.proc.poll() is not None:
            blockers = [f"exited with {z.proc.returncode}"]
        if blockers:
            logger.warning(
                "worker %s starts cold: its warm process cannot run it (%s)",
                key,
                ", ".join(blockers),
            )
            self._discard(z)
            return None
        job = json.dumps({"env": env, "cwd": os.getcwd()}).encode()
        try:
            socket.send_fds(z.sock, [struct.pack("!I", len(job))], [_fd(stdout, 1), _fd(stderr, 2)])
            z.sock.sendall(job)
        except OSError as e:
            logger.warning("worker %s starts cold: hand-off failed (%s)", key, e)
            self._discard(z)
            return None
        z.sock.close()
        return z.proc

    # -- keeping the pool filled ----------------------------------------------------------------
    def tick(self) -> list[Hashable]:
        """Start the zygotes that are due and reap dead ones; returns the keys whose zygote
        became ready since the last call. Call it often (the agent does on every monitor tick)."""
        with self._lock:
            return self._tick()

    def _tick(self) -> list[Hashable]:
        became_ready = []
        now = self.clock()
        for key, slot in self._slots.items():
            z = slot.zygote
            if z is not None and z.proc.poll() is not None:
                slot.deaths += 1
                logger.warning(
                    "warm process for %s exited (%s) before use%s",
                    key,
                    z.proc.returncode,
                    "; no more warm starts for it" if slot.deaths >= MAX_DEATHS else "",
                )
                self._discard(z)
                slot.zygote, slot.since, z = None, now, None
            if z is None:
                if (
                    not self._closed
                    and slot.deaths < MAX_DEATHS
                    and now - slot.since >= self.prestart_delay_s
                    and warm_argv_ok(slot.argv)
                ):
                    slot.zygote = self._start_zygote(slot)
                continue
            if not z.ready and _readable(z.sock):
                z.ready = z.sock.recv(1) == b"R"
                if z.ready:
                    became_ready.append(key)
        return became_ready

    def ready(self) -> dict[Hashable, int]:
        """Key → pid of each zygote that has finished its imports and waits for a job."""
        with self._lock:
            return {
                k: s.zygote.proc.pid for k, s in self._slots.items() if s.zygote and s.zygote.ready
            }

    def _start_zygote(self, slot: _Slot) -> _Zygote | None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(slot.env)
        pythonpath = [HOOK_DIR, *filter(None, [_without_hook(env.get("PYTHONPATH"))])]
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
        env[FD_ENV] = str(theirs.fileno())
        env[PRELOAD_ENV] = ",".join(self.preload)
        try:
            proc = subprocess.Popen(
                slot.argv,
                env=env,
                pass_fds=(theirs.fileno(),),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as e:
            logger.warning("cannot start a warm process (%s)", e)
            ours.close()
            slot.deaths = MAX_DEATHS
            return None
        finally:
            theirs.close()
        logger.debug("warm process %s started for %s", proc.pid, slot.argv)
        return _Zygote(proc=proc, sock=ours, argv=slot.argv, env=dict(slot.env))

    # -- ending ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every unused zygote by PID (idempotent); handed-off workers are not touched."""
        with self._lock:
            self._closed = True
            for slot in self._slots.values():
                if slot.zygote is not None:
                    self._discard(slot.zygote)
                    slot.zygote = None

    def serving_torch_workers(self) -> Any:
        """:func:`serving_torch_workers` with this pool (the agent's entry point)."""
        return serving_torch_workers(self)

    @staticmethod
    def _discard(z: _Zygote) -> None:
        z.sock.close()
        try:
            os.killpg(z.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            z.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("warm process %s did not exit after SIGKILL", z.proc.pid)


def _fd(stream: IO[Any] | int | None, default: int) -> int:
    if stream is None:
        return default
    return stream if isinstance(stream, int) else stream.fileno()


def _readable(sock: socket.socket) -> bool:
    r, _, _ = select.select([sock], [], [], 0)
    return bool(r)


class PooledSubprocessHandler(_torch.SubprocessHandlerBase):
    """torch's ``SubprocessHandler`` (torch keeps its ``poll``/``killpg``/reporting) whose
    process comes from ``pool`` (keyed by local rank) when given, else torch's own ``Popen``.
    ``mode="a"`` appends to the redirected log files instead of truncating them (an in-process
    replacement keeps the dead worker's output). NUMA-bound workers never come from the pool.
    ``warm``: the process came pre-started."""

    def __init__(
        self,
        entrypoint: str,
        args: tuple[Any, ...],
        env: dict[str, str],
        stdout: str | None,
        stderr: str | None,
        local_rank_id: int,
        *,
        pool: WarmPool | None = None,
        mode: Literal["w", "a"] = "w",
        numa_options: Any = None,
    ) -> None:
        # what SubprocessHandler.__init__ does, with the pool's process
        self.open_logs(stdout, stderr, mode)
        env_vars = os.environ.copy()
        env_vars.update(env)
        self.local_rank_id = local_rank_id
        argv: tuple[str, ...] = (entrypoint, *[str(a) for a in args])
        self.warm = False
        if numa_options is not None:
            argv = _torch.wrap_numa_binding(
                argv, gpu_index=local_rank_id, numa_options=numa_options
            )
            pool = None
        if pool is None:
            self.proc = self.popen(argv, env_vars)
            return
        started = pool.spawn(
            argv, env_vars, stdout=self.stdout_file, stderr=self.stderr_file, key=local_rank_id
        )
        self.proc = started.proc
        self.warm = started.warm


@contextmanager
def serving_torch_workers(pool: WarmPool | None) -> Iterator[dict[int, bool]]:
    """While active, torch's ``SubprocessContext`` starts its workers through ``pool`` (keyed by
    local rank); yields local rank → started warm. torch keeps its own handler class, files,
    ``poll``/``killpg`` teardown and failure reporting: only the ``Popen`` comes from the pool.
    NUMA-bound workers (``--numa-binding``) start cold. Use it around one
    ``start_workers`` call in the agent's main thread."""
    started: dict[int, bool] = {}
    if pool is None:
        yield started
        return
    from torch.distributed.elastic.multiprocessing import api as mp_api

    original = mp_api.get_subprocess_handler

    def get_subprocess_handler(
        entrypoint: str,
        args: tuple[Any, ...],
        env: dict[str, str],
        stdout: str,
        stderr: str,
        local_rank_id: int,
        numa_options: Any = None,
    ) -> SubprocessHandler:
        if numa_options is not None:
            started[local_rank_id] = False
            return original(
                entrypoint, args, env, stdout, stderr, local_rank_id, numa_options=numa_options
            )
        h = PooledSubprocessHandler(entrypoint, args, env, stdout, stderr, local_rank_id, pool=pool)
        started[local_rank_id] = h.warm
        return h

    mp_api.get_subprocess_handler = get_subprocess_handler
    try:
        yield started
    finally:
        mp_api.get_subprocess_handler = original
