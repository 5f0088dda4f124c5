"""The one place trainguard reaches into torch's private (underscore) internals.

trainguard wraps ``torch.distributed.elastic`` rather than forking it, and a few things it
needs are not public there: the agent's process context and restart budget, the dynamic
rendezvous handler's node, settings, store and state, torch's rendezvous state classes (the
etcd-v3 backend encodes them), the signal handler torch installs for its own signals and the
NUMA command wrapper. Every such name is used here and only here (a test greps the rest of
the package), and :data:`PRIVATES` lists them: a test asserts each one still exists on the
installed torch, so a torch upgrade that renames one fails there, naming it, instead of at
run time in a job.

The rest of trainguard sees public names: :class:`ElasticAgentBase` (torch's
``LocalElasticAgent`` with its protected hooks and state under public names),
:class:`SubprocessHandlerBase` (the same for ``SubprocessHandler``) and the functions below.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import IO, TYPE_CHECKING, Any, Literal, cast, overload

from torch.distributed import Store
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import PContext
from torch.distributed.elastic.multiprocessing import api as _mp_api
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous import api as _rdzv_api
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as _dr
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousSettings,
    Token,
)

if TYPE_CHECKING:
    from torch.numa.binding import NumaOptions  # torch >= 2.9

__all__ = [
    "PRIVATES",
    "ElasticAgentBase",
    "NodeDesc",
    "RendezvousState",
    "StateHolderBase",
    "SubprocessHandlerBase",
    "cheap_rendezvous_event_names",
    "forget_signals_raised",
    "handler_backend",
    "handler_node",
    "handler_settings",
    "handler_state",
    "handler_state_holder",
    "handler_state_pending",
    "handler_store",
    "leave_rendezvous",
    "numa_options_of",
    "remove_participant_epilogue",
    "repair_error_files",
    "record_terminate_signals",
    "recording_terminate_handler",
    "reserved_bootstrap_port",
    "running_worker_pids",
    "signal_raised",
    "take_reserved_port",
    "terminate_process_handler",
    "worker_exitcodes",
    "wrap_numa_binding",
]

PRIVATES: tuple[tuple[str, str, str], ...] = (
    # (module, class or "" for the module itself, private name)
    # the agent (torch.distributed.elastic.agent.server)
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_worker_group"),
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_remaining_restarts"),
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_rendezvous"),
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_restart_workers"),
    (
        "torch.distributed.elastic.agent.server.local_elastic_agent",
        "LocalElasticAgent",
        "_pcontext",
    ),
    (
        "torch.distributed.elastic.agent.server.local_elastic_agent",
        "LocalElasticAgent",
        "_start_workers",
    ),
    (
        "torch.distributed.elastic.agent.server.local_elastic_agent",
        "LocalElasticAgent",
        "_monitor_workers",
    ),
    # process contexts and handlers (torch.distributed.elastic.multiprocessing)
    ("torch.distributed.elastic.multiprocessing.api", "", "_terminate_process_handler"),
    ("torch.distributed.elastic.multiprocessing.api", "MultiprocessContext", "_pc"),
    ("torch.distributed.elastic.multiprocessing.api", "SubprocessContext", "_numa_options"),
    (
        "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler",
        "SubprocessHandler",
        "_popen",
    ),
    (
        "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler",
        "SubprocessHandler",
        "_stdout",
    ),
    (
        "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler",
        "SubprocessHandler",
        "_stderr",
    ),
    ("torch.numa.binding", "", "_maybe_wrap_command_args_with_numa_binding"),
    # the name RendezvousStoreInfo.build calls for the round's MASTER_PORT (public, but looked
    # up in this module: reserved_bootstrap_port replaces it while a round is joined)
    ("torch.distributed.elastic.rendezvous.api", "", "get_free_port"),
    # the dynamic rendezvous (torch.distributed.elastic.rendezvous.dynamic_rendezvous)
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "", "_NodeDesc"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "", "_RendezvousState"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "", "_RendezvousExitOp"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "", "_remove_participant_epilogue"),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "DynamicRendezvousHandler",
        "_this_node",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "DynamicRendezvousHandler",
        "_settings",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "DynamicRendezvousHandler",
        "_store",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "DynamicRendezvousHandler",
        "_state_holder",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "DynamicRendezvousHandler",
        "_stop_heartbeats",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "DynamicRendezvousHandler",
        "_keep_alive",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "DynamicRendezvousHandler",
        "_op_executor",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "DynamicRendezvousHandler",
        "_get_deadline",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "",
        "_BackendRendezvousStateHolder",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "_BackendRendezvousStateHolder",
        "_backend",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "_BackendRendezvousStateHolder",
        "_state",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "_BackendRendezvousStateHolder",
        "_token",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "_BackendRendezvousStateHolder",
        "_dirty",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "_BackendRendezvousStateHolder",
        "_last_sync_time",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "_BackendRendezvousStateHolder",
        "_cache_duration",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "_BackendRendezvousStateHolder",
        "_settings",
    ),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "_BackendRendezvousStateHolder",
        "_sanitize",
    ),
)
"""Every torch private trainguard uses: (module, class or "" for the module, name). An
attribute set in ``__init__`` counts as existing when the class's source assigns it."""

NodeDesc = _dr._NodeDesc
"""torch's rendezvous node descriptor (address, pid, local id)."""
RendezvousState = _dr._RendezvousState
"""torch's rendezvous state (round, participants, wait list, redundancy list, ...)."""
terminate_process_handler = _mp_api._terminate_process_handler
"""The handler torch installs for the signals it handles (raises ``SignalException``)."""

_first_signal: signal.Signals | None = None
"""The first signal torch's handler raised ``SignalException`` for in this process."""


def recording_terminate_handler(signum: int, frame: Any) -> None:
    """torch's handler, remembering the signal first: ``SignalException`` is an ``Exception``,
    and an ``except Exception`` that the main thread happens to be in (a plugin hook, a
    metrics read) swallows it; :func:`signal_raised` still says it came."""
    global _first_signal
    if _first_signal is None:
        _first_signal = signal.Signals(signum)
    terminate_process_handler(signum, frame)


def record_terminate_signals() -> None:
    """Put :func:`recording_terminate_handler` in place of torch's handler wherever torch
    installed it (its process context does on every start of the workers). Main thread only,
    like ``signal.signal``."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in signal.valid_signals():
        try:
            if signal.getsignal(sig) is terminate_process_handler:
                signal.signal(sig, recording_terminate_handler)
        except (OSError, ValueError, TypeError):
            continue


def forget_signals_raised() -> None:
    """A new agent in this process (``launch`` called again): no signal came to it yet."""
    global _first_signal
    _first_signal = None


def signal_raised() -> signal.Signals | None:
    """The first signal torch's handler raised on in this process (None: none yet)."""
    return _first_signal


def remove_participant_epilogue(state: RendezvousState, settings: RendezvousSettings) -> None:
    """torch's bookkeeping after participants leave ``state`` (closes or reopens the round)."""
    _dr._remove_participant_epilogue(state, settings)


# -- the dynamic rendezvous handler ------------------------------------------------------------
class QuietKeepAliveHandler(_dr.DynamicRendezvousHandler):
    """torch's dynamic handler whose periodic keep-alive runs inside its state holder's
    ``keep_alive_only()`` when the holder has one (the etcd-v3 holder then reads nothing for
    it: its keep-alive renews a lease, it writes no state), and whose ``num_nodes_waiting``
    also counts the end of the round this node's workers run in: the etcd-v3 holder ends a
    complete round for every node when its first participant leaves it (torch's agents
    restart their workers when nodes wait; a node whose workers hang on a lost peer then
    restarts them at once instead of waiting for the collective's timeout)."""

    _joined_round: int | None = None

    def next_rendezvous(self) -> RendezvousInfo:
        deadline = getattr(self._state_holder, "deadline", None)
        try:
            with deadline.in_rendezvous() if deadline is not None else contextlib.nullcontext():
                info = super().next_rendezvous()
        except RendezvousTimeoutError:
            # torch's error names nothing; the etcd-v3 holder says what the round lacked
            if deadline is None:
                raise
            raise RendezvousTimeoutError(deadline.incomplete(self._settings.timeout.join)) from None
        except RendezvousConnectionError as e:
            # the etcd-v3 holder retries etcd until the join deadline: an error then is the
            # round's timeout, said with what it lacked
            text = deadline.unavailable(self._settings.timeout.join, e) if deadline else None
            if text is None:
                raise
            raise RendezvousTimeoutError(text) from None
        self._joined_round = self._state_holder.state.round
        return info

    def after_round(self, seconds: float) -> contextlib.AbstractContextManager[None]:
        """A block of work in the round's store right after :meth:`next_rendezvous`, during
        which the state holder's backend (etcd-v3) retries an unanswered call for ``seconds``
        rather than only its ``retry_timeout``; a no-op for other backends."""
        deadline = getattr(self._state_holder, "deadline", None)
        return deadline.retrying_for(seconds) if deadline is not None else contextlib.nullcontext()

    def _get_deadline(self, timeout: timedelta) -> float:
        deadline = super()._get_deadline(timeout)
        if timeout == self._settings.timeout.join:  # the rendezvous' (not a keep-alive's)
            holder_deadline = getattr(self._state_holder, "deadline", None)
            if holder_deadline is not None:
                holder_deadline.round_deadline(deadline)
        return deadline

    def num_nodes_waiting(self) -> int:
        waiting = super().num_nodes_waiting()
        joined = self._joined_round
        if waiting == 0 and joined is not None and self._state_holder.state.round > joined:
            return 1  # the round this node's workers run in is over
        return waiting

    def _keep_alive(self) -> None:
        quiet = getattr(self._state_holder, "keep_alive_only", None)
        if quiet is None:
            super()._keep_alive()
            return
        with quiet():
            super()._keep_alive()


def _method_name(depth: int = 2) -> str:
    """torch's ``dynamic_rendezvous.get_method_name`` (the name of the function ``depth``
    frames up, for the name of a rendezvous event) without ``inspect.stack()``, which reads
    the source lines of every frame of the stack and scans every loaded module per frame:
    ~25 ms per event on a CPU, several events per node and round (15 % of an agent's CPU in a
    short job; most of a node's CPU in a 1000-node rendezvous)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def cheap_rendezvous_event_names() -> None:
    """Name torch's rendezvous events (every backend's) with :func:`_method_name`."""
    if getattr(_dr, "get_method_name", None) is not None:
        _dr.get_method_name = _method_name


# torch's dynamic handler has these (every torch trainguard supports: PRIVATES), so for one
# the accessors return them; for any other handler, None.
@overload
def handler_node(handler: DynamicRendezvousHandler) -> NodeDesc: ...
@overload
def handler_node(handler: object) -> NodeDesc | None: ...
def handler_node(handler: object) -> NodeDesc | None:
    """This agent's :data:`NodeDesc` in torch's dynamic handler; None for another handler."""
    return getattr(handler, "_this_node", None)


@overload
def handler_settings(handler: DynamicRendezvousHandler) -> RendezvousSettings: ...
@overload
def handler_settings(handler: object) -> RendezvousSettings | None: ...
def handler_settings(handler: object) -> RendezvousSettings | None:
    """torch's ``RendezvousSettings`` of a dynamic handler (run id, min/max nodes, timeouts);
    None for another handler."""
    return getattr(handler, "_settings", None)


@overload
def handler_store(handler: DynamicRendezvousHandler) -> Store: ...
@overload
def handler_store(handler: object) -> Store | None: ...
def handler_store(handler: object) -> Store | None:
    """The backend's store a dynamic handler keeps (outlives the rounds); None for another."""
    return getattr(handler, "_store", None)


def handler_backend(handler: DynamicRendezvousHandler) -> RendezvousBackend:
    """The ``RendezvousBackend`` behind a dynamic handler's state holder (raises
    ``AttributeError`` for another handler)."""
    # torch's handler declares the protocol, its holder is the backend one
    return cast("_dr._BackendRendezvousStateHolder", handler._state_holder)._backend


def handler_state(handler: DynamicRendezvousHandler) -> RendezvousState:
    """The :data:`RendezvousState` a dynamic handler last synced (no store read)."""
    return handler._state_holder.state


def handler_state_holder(handler: Any) -> Any:
    """The state holder of a dynamic handler (torch's, or the etcd-v3 backend's own)."""
    return handler._state_holder


def handler_state_pending(handler: DynamicRendezvousHandler) -> bool:
    """Whether the state a dynamic handler holds has changes of its own not written yet
    (torch's op changed it in place and its write or the wait for it is under way)."""
    return bool(getattr(handler._state_holder, "dirty", False))


logger = logging.getLogger(__name__)

_reserved = threading.local()
_reserve_lock = threading.Lock()
_reserve_depth = 0
_torch_get_free_port: Any = None


def _listening_socket() -> socket.socket:
    """A socket listening on a free port on every interface, as the TCPStore server that will
    take it over would bind (dual-stack IPv6 where the host has it, else IPv4)."""
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        except OSError:
            pass
    return socket.create_server(("0.0.0.0", 0))


def _reserving_get_free_port() -> int:
    sock = _listening_socket()
    old = getattr(_reserved, "sock", None)
    if old is not None:
        old.close()
    _reserved.sock = sock
    return int(sock.getsockname()[1])


@contextlib.contextmanager
def reserved_bootstrap_port() -> Iterator[None]:
    """While a round is joined: the port torch picks for the round's ``MASTER_PORT`` (rank 0
    only, :meth:`RendezvousStoreInfo.build`) stays bound, by a listening socket kept for the
    calling thread, instead of being closed at once and bound again later (torch's
    ``get_free_port`` says the port "is not reserved": another process's connection took it
    in loaded runs, and the round's store failed with EADDRINUSE). Take the socket with
    :func:`take_reserved_port` and hand it to the store (``master_listen_fd``), or close it.
    Process-wide and counted, like the environment flip around the same call; without the
    name on this torch the port is picked as torch does."""
    global _reserve_depth, _torch_get_free_port
    with _reserve_lock:
        if _reserve_depth == 0:
            current = getattr(_rdzv_api, "get_free_port", None)
            if current is not None and current is not _reserving_get_free_port:
                _torch_get_free_port = current
                _rdzv_api.get_free_port = _reserving_get_free_port
        _reserve_depth += 1
    try:
        yield
    finally:
        with _reserve_lock:
            _reserve_depth -= 1
            if _reserve_depth == 0 and _torch_get_free_port is not None:
                _rdzv_api.get_free_port = _torch_get_free_port
                _torch_get_free_port = None


def take_reserved_port(port: int) -> socket.socket | None:
    """The calling thread's reserved listening socket if it holds ``port`` (the round's
    ``MASTER_PORT``), else None; any other reservation is closed. The caller owns it."""
    sock: socket.socket | None = getattr(_reserved, "sock", None)
    _reserved.sock = None
    if sock is None:
        return None
    if sock.getsockname()[1] == port:
        return sock
    sock.close()
    return None


def leave_rendezvous(handler: RendezvousHandler, deadline: float) -> None:
    """Take this node out of the rendezvous now (torch's exit operation), by ``deadline``
    (monotonic); raises what torch raises, ``TypeError`` for a handler other than torch's
    dynamic one (the static backend's)."""
    if not isinstance(handler, DynamicRendezvousHandler):
        raise TypeError(f"{type(handler).__name__} is not torch's dynamic rendezvous handler")
    handler._stop_heartbeats()
    handler._op_executor.run(_dr._RendezvousExitOp(), deadline)


# -- process contexts --------------------------------------------------------------------------
def numa_options_of(pcontext: object) -> NumaOptions | None:
    """The NUMA options a ``SubprocessContext`` starts its workers with (None: none)."""
    return getattr(pcontext, "_numa_options", None)


def worker_exitcodes(pcontext: object) -> list[int | None]:
    """Exit codes of a process context's workers (script or function entrypoints); empty
    when none were started."""
    handlers = getattr(pcontext, "subprocess_handlers", None)
    if handlers:
        return [h.proc.returncode for h in handlers.values()]
    procs = getattr(getattr(pcontext, "_pc", None), "processes", None)
    if procs:
        return [p.exitcode for p in procs]
    return []


def running_worker_pids(pcontext: object) -> set[int]:
    """PIDs of a process context's workers that have not exited (script or function
    entrypoints)."""
    handlers = getattr(pcontext, "subprocess_handlers", None)
    if handlers:
        return {h.proc.pid for h in handlers.values() if h.proc.poll() is None}
    procs = getattr(getattr(pcontext, "_pc", None), "processes", None)
    return {p.pid for p in procs or () if p.is_alive()}


def raised_workers(pcontext: Any) -> list[int]:
    """Local ranks of a process context's workers that exited non-zero and left an error
    file (an exception)."""
    import os

    handlers = getattr(pcontext, "subprocess_handlers", None) or {}
    files = getattr(pcontext, "error_files", None) or {}
    return [
        lr
        for lr, h in handlers.items()
        if h.proc.poll() not in (None, 0) and files.get(lr) and os.path.isfile(files[lr])
    ]


ERROR_FILE_MAX_BYTES = 16 << 20
"""A worker's error file larger than this is replaced (torch would read all of it)."""
_ERROR_FILE_MAX_DEPTH = 32


def _json_depth_ok(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > limit:
                return False
            items = v.values() if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items)
    return True


def error_file_accepted(path: str) -> bool:
    """Whether torch's own reader of a worker's error file (``ProcessFailure``: it loads the
    JSON, logs it re-indented, reads ``message`` and its timestamp, and later formats
    ``message.extraInfo``) takes the file without raising. Checked with torch's own parser on
    a bounded read (size and nesting: torch would recurse on a deeply nested one)."""
    import json
    import os

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    try:
        if os.path.getsize(path) > ERROR_FILE_MAX_BYTES:
            return False
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or not _json_depth_ok(data, _ERROR_FILE_MAX_DEPTH):
            return False
        json.dumps(data, indent=2)  # torch logs it so, before it reads it
        message, _timestamp = ProcessFailure._get_error_data(None, data)  # type: ignore[arg-type]
        if isinstance(message, dict):
            info = message.get("extraInfo", {})
            return isinstance(info, dict)
        return isinstance(message, str)
    except Exception:  # anything torch's reader would raise on as well
        return False


def repair_error_files(pcontext: Any) -> list[int]:
    """Rewrite the error file of every exited worker that torch's reader would not accept
    (:func:`error_file_accepted`: no JSON, as of a worker killed while writing it, or JSON of
    another shape: ``{}``, ``[]``, no timestamp, absurd nesting) as a short valid one; torch
    reads each exited worker's error file and raises on anything else, which would end the
    agent. Written through an exclusive temporary file, never through a symlink planted next
    to the error file. The local ranks repaired."""
    import json
    import os

    from trainguard.core.atomicfile import write_atomic

    handlers = getattr(pcontext, "subprocess_handlers", None) or {}
    files = getattr(pcontext, "error_files", None) or {}
    repaired = []
    for local_rank, h in handlers.items():
        path = files.get(local_rank)
        if not path or h.proc.poll() is None or not os.path.isfile(path):
            continue
        if error_file_accepted(path):
            continue
        try:
            when = int(os.path.getmtime(path))
        except OSError:
            when = 0
        data = {
            "message": {
                "message": "the worker's error file was unreadable or not in torch's format "
                "(killed while writing it, or written by other code); trainguard replaced it",
                "extraInfo": {"py_callstack": "", "timestamp": str(when)},
            }
        }
        write_atomic(path, json.dumps(data))
        repaired.append(local_rank)
    return repaired


def wrap_numa_binding(
    argv: tuple[str, ...], *, gpu_index: int, numa_options: NumaOptions | None
) -> tuple[str, ...]:
    """``argv`` wrapped the way torch binds a worker to its GPU's NUMA node."""
    from torch.numa.binding import _maybe_wrap_command_args_with_numa_binding

    return _maybe_wrap_command_args_with_numa_binding(
        argv, gpu_index=gpu_index, numa_options=numa_options
    )


class SubprocessHandlerBase(SubprocessHandler):
    """torch's ``SubprocessHandler`` with its protected parts under public names:
    :meth:`popen` (override it; torch calls it through ``_popen``), the redirected log files
    (:attr:`stdout_file`, :attr:`stderr_file`, :meth:`open_logs`)."""

    def _popen(self, args: tuple, env: dict[str, str]) -> subprocess.Popen:
        return self.popen(args, env)

    def popen(self, args: tuple, env: dict[str, str]) -> subprocess.Popen:
        """Start the worker process (torch's own ``Popen`` unless overridden)."""
        return super()._popen(args, env)

    def open_logs(
        self, stdout: str | None, stderr: str | None, mode: Literal["w", "a"] = "w"
    ) -> None:
        """Open the log files torch's ``close`` closes (what its ``__init__`` does)."""
        self._stdout = open(stdout, mode) if stdout else None  # noqa: SIM115
        self._stderr = open(stderr, mode) if stderr else None  # noqa: SIM115

    @property
    def stdout_file(self) -> IO[Any] | None:
        return getattr(self, "_stdout", None)

    @property
    def stderr_file(self) -> IO[Any] | None:
        return getattr(self, "_stderr", None)


def close_logs(handler: object) -> None:
    """Close the log files of any torch ``SubprocessHandler`` (not its process)."""
    for f in (getattr(handler, "_stdout", None), getattr(handler, "_stderr", None)):
        if f is not None:
            f.close()


class ElasticAgentBase(LocalElasticAgent):
    """torch's ``LocalElasticAgent`` with the protected state and hooks trainguard uses under
    public names. torch calls ``_rendezvous``, ``_start_workers``, ``_monitor_workers`` and
    ``_restart_workers``; they call :meth:`rendezvous_workers`, :meth:`start_workers`,
    :meth:`monitor_workers` and :meth:`restart_workers`, which subclasses override (calling
    ``super()`` for torch's behaviour)."""

    # -- state ---------------------------------------------------------------------------------
    @property
    def worker_group(self) -> WorkerGroup:
        return self._worker_group

    @property
    def pcontext(self) -> PContext | None:
        """torch's process context of the current workers (None before the first start)."""
        return getattr(self, "_pcontext", None)

    @property
    def remaining_restarts(self) -> int:
        """Restarts left of ``--max-restarts`` (torch counts down)."""
        return self._remaining_restarts

    @remaining_restarts.setter
    def remaining_restarts(self, n: int) -> None:
        self._remaining_restarts = n

    # -- hooks ---------------------------------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self.rendezvous_workers(worker_group)

    def rendezvous_workers(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        return self.start_workers(worker_group)

    def start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        return super()._start_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        return self.monitor_workers(worker_group)

    def monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        return super()._monitor_workers(worker_group)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self.restart_workers(worker_group)

    def restart_workers(self, worker_group: WorkerGroup) -> None:
        super()._restart_workers(worker_group)


class StateHolderBase(_dr._BackendRendezvousStateHolder):
    """torch's rendezvous state holder over a ``RendezvousBackend``, its protected fields
    under public names, for a holder that replaces how it syncs (the etcd-v3 one)."""

    @property
    def held(self) -> RendezvousState:
        """The :data:`RendezvousState` held (torch's ``state`` property, settable)."""
        return self._state

    @held.setter
    def held(self, state: RendezvousState) -> None:
        self._state = state

    @property
    def token(self) -> Token:
        """The backend's fencing token of :attr:`held` (torch's ``Token``: any value)."""
        return self._token

    @token.setter
    def token(self, token: Token) -> None:
        self._token = token

    @property
    def dirty(self) -> bool:
        """Whether :attr:`held` has changes to write."""
        return self._dirty

    @dirty.setter
    def dirty(self, dirty: bool) -> None:
        self._dirty = dirty

    @property
    def last_sync_time(self) -> float:
        return self._last_sync_time

    @last_sync_time.setter
    def last_sync_time(self, t: float) -> None:
        self._last_sync_time = t

    @property
    def cache_duration(self) -> float:
        return self._cache_duration

    @property
    def settings(self) -> RendezvousSettings:
        return self._settings

    def sanitize(self) -> None:
        """torch's clean-up of :attr:`held` (drops dead nodes past their keep-alive)."""
        self._sanitize()
