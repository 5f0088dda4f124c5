"""trainguard's warm-start hook (standard library only; loaded through PYTHONPATH).

A warm worker is started ahead of need with exactly the worker's command line
(``python -u script.py args...``) and this directory first on ``PYTHONPATH``. Python imports
this module while it initialises, before ``__main__`` runs: it imports the modules listed in
``TRAINGUARD_ZYGOTE_PRELOAD`` (torch, ...), tells the agent it is ready and blocks on the agent's
socket. When the agent hands it a worker it receives the worker's environment, working
directory and stdout/stderr descriptors, puts them in place, loads the user's own
``sitecustomize`` if there is one, and returns: the interpreter then runs the script (or
``-m`` module) itself, as it would have in a fresh process. If the agent goes away first
(the socket closes) or anything fails before the hand-off, the process exits without
running the script.

The agent also puts this directory on every worker's ``PYTHONPATH`` (cold starts too): in a
worker, the hook starts trainguard's collective progress watcher before the script runs (hang
detection for scripts that never call ``tg.step()``).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys

_FD_ENV = "TRAINGUARD_ZYGOTE_FD"
_PRELOAD_ENV = "TRAINGUARD_ZYGOTE_PRELOAD"
_HERE = os.path.dirname(os.path.abspath(__file__))
_WATCH_ENV = "TRAINGUARD_AGENT_COLLECTIVES"  # trainguard.core.collectives.WATCH_ENV
_FR_AGENT_ENV = "TRAINGUARD_AGENT_FR_BUFFER_SIZE"  # trainguard.core.collectives
_FR_ENV = "TORCH_FR_BUFFER_SIZE"
_INTEGRATIONS_ENV = "TRAINGUARD_AGENT_INTEGRATIONS"  # trainguard.runtime.agent
_ERROR_FILE_ENV = "TRAINGUARD_AGENT_ERROR_FILE"  # trainguard.core.envvars.ERROR_FILE_HOOK
_ABORT = 111  # exit code of a zygote that never got a job (the agent ignores it)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = b""
    while len(buf) < n:
        msg, got, _flags, _addr = socket.recv_fds(sock, n - len(buf), 4)
        fds.extend(got)
        if not msg:
            os._exit(_ABORT)  # the agent closed the socket: no job will come
        buf += msg
    return buf


def _chain_user_sitecustomize() -> None:
    """Run the ``sitecustomize`` this hook shadowed, as ``site`` would have."""
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # site's own wording
        print(
            f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
            f"{type(err).__name__}: {err}",
            file=sys.stderr,
        )


def _wait_for_job(fd: int) -> None:
    for name in filter(None, os.environ.pop(_PRELOAD_ENV, "").split(",")):
        try:
            __import__(name)
        except Exception:  # the worker imports it itself (and reports the error)
            pass
    sock = socket.socket(fileno=fd)
    try:
        sock.sendall(b"R")
    except OSError:
        pass  # the agent handed us a job (and closed its end) before we were ready
    fds: list[int] = []
    (size,) = struct.unpack("!I", _recv_exact(sock, 4, fds))
    job = json.loads(_recv_exact(sock, size, fds))
    if len(fds) != 2:
        os._exit(_ABORT)
    for target, got in zip((1, 2), fds, strict=True):
        os.dup2(got, target)
        os.close(got)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    sock.close()


def _leave_pythonpath() -> None:
    """Take this directory off the ``PYTHONPATH`` the script sees (and its own children
    inherit): the worker's environment stays exactly the launcher's."""
    kept = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and os.path.abspath(p) != _HERE
    ]
    if kept:
        os.environ["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        os.environ.pop("PYTHONPATH", None)


def _attach_integrations() -> None:
    """``[integrations] auto``: trainguard.integrations.auto attaches trainguard to the
    framework's Trainer when the script imports it (it imports no framework itself)."""
    if not os.environ.get(_INTEGRATIONS_ENV):
        return
    try:
        from trainguard.integrations.auto import install

        install()
    except Exception as err:  # never keep the script from running
        print(f"trainguard: framework integrations not installed ({err})", file=sys.stderr)


def _watch_collectives() -> None:
    """In a worker of a trainguard agent: start the collective progress watcher (a daemon
    thread, trainguard.core.collectives)."""
    if not os.environ.get(_WATCH_ENV):
        return
    fr_size = os.environ.pop(_FR_AGENT_ENV, None)
    if fr_size and _FR_ENV not in os.environ:  # torch's getenv sees it, os.environ does not
        os.putenv(_FR_ENV, fr_size)
    try:
        from trainguard.core.collectives import start_from_env

        start_from_env()
    except Exception as err:  # never keep the script from running
        print(f"trainguard: collective progress watcher not started: {err}", file=sys.stderr)


def _record_errors() -> None:
    """An uncaught exception is written as torch's error file (trainguard.core.errorfile), so
    the agent knows it without ``@record`` in the script."""
    if not os.environ.get(_ERROR_FILE_ENV):
        return
    try:
        from trainguard.core.errorfile import install_excepthook

        install_excepthook()
    except Exception as err:  # never keep the script from running
        print(f"trainguard: uncaught exceptions not recorded: {err}", file=sys.stderr)


def _main() -> None:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    fd = os.environ.pop(_FD_ENV, None)
    if fd is not None:
        try:
            _wait_for_job(int(fd))
        except BaseException:
            os._exit(_ABORT)
    _leave_pythonpath()
    _record_errors()
    _watch_collectives()
    _attach_integrations()
    _chain_user_sitecustomize()


_main()
