"""The worker start-up hook: what runs in a worker's interpreter before the script.

``runtime/_zygote/sitecustomize.py`` (a thin file; the agent puts its directory first on the
``PYTHONPATH`` of workers started as ``python script.py``) imports this module and calls
:func:`main`, which

1. in a pre-started process (a warm start, :mod:`trainguard.runtime.warm`): imports the
   preload modules, tells the agent it is ready and blocks until the agent hands it a worker
   (environment, working directory, stdout/stderr descriptors), then puts them in place;
2. takes the hook's directory off ``PYTHONPATH`` (the script and every process it starts see
   torchrun's environment, not trainguard's hook);
3. calls the ``module:function`` entries the agent's plugins registered
   (:data:`trainguard.core.contracts.envvars.WORKER_HOOKS`, removed from the environment first), in
   order; an entry that fails prints one line and the script runs anyway;
4. runs the user's own ``sitecustomize``, which this hook shadowed, as ``site`` would have.

It names no feature: the collective watcher, the framework integrations, ... are entries a
plugin declared (:meth:`trainguard.core.plugin.AgentPlugin.worker_hooks`). Standard library and
:mod:`trainguard.core.contracts.envvars` only (an import-linter contract keeps it to the core),
and in a pre-started process :mod:`trainguard.core.procs` (its collector pause): it runs in
every worker before the script, so it must import nothing heavy.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import socket
import struct
import sys
from collections.abc import Iterable

from trainguard.core.contracts import envvars

__all__ = ["HOOK_DIR", "check_entry", "main", "parse_entries", "run_entries"]

HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_zygote")
"""The directory the agent puts first on a Python worker's ``PYTHONPATH``."""
ABORT_EXIT_CODE = 111
"""Exit code of a pre-started process that never got a worker (the agent ignores it)."""


def check_entry(entry: str) -> str:
    """``entry`` if it is a ``module:function`` name; ValueError (naming it) otherwise."""
    module, sep, func = entry.partition(":")
    if not (sep and module and func) or not all(
        part.isidentifier() for part in (*module.split("."), func)
    ):
        raise ValueError(f"worker hook {entry!r} is not a 'module:function' name")
    return entry


def parse_entries(value: str | None) -> list[str]:
    """The entries of a :data:`~trainguard.core.contracts.envvars.WORKER_HOOKS` value."""
    return [e.strip() for e in (value or "").split(",") if e.strip()]


def run_entries(entries: Iterable[str]) -> list[str]:
    """Call each ``module:function``; returns the entries that failed (each printed as one
    line on stderr). Never raises: a hook must not keep the script from running."""
    failed = []
    for entry in entries:
        try:
            module, _, func = check_entry(entry).partition(":")
            getattr(importlib.import_module(module), func)()
        except Exception as err:
            failed.append(entry)
            print(
                f"trainguard: worker start-up hook {entry} failed ({type(err).__name__}: {err}); "
                "the script runs without it",
                file=sys.stderr,
            )
    return failed


def without_hook_dir(pythonpath: str | None) -> str | None:
    """``PYTHONPATH`` without :data:`HOOK_DIR`; None when nothing else is left."""
    kept = [p for p in (pythonpath or "").split(os.pathsep) if p and os.path.abspath(p) != HOOK_DIR]
    return os.pathsep.join(kept) or None


def _leave_pythonpath() -> None:
    kept = without_hook_dir(os.environ.get("PYTHONPATH"))
    if kept:
        os.environ["PYTHONPATH"] = kept
    else:
        os.environ.pop("PYTHONPATH", None)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = b""
    while len(buf) < n:
        msg, got, _flags, _addr = socket.recv_fds(sock, n - len(buf), 4)
        fds.extend(got)
        if not msg:
            os._exit(ABORT_EXIT_CODE)  # the agent closed the socket: no job will come
        buf += msg
    return buf


def _wait_for_job(fd: int) -> None:
    """A pre-started process: preload, say ready, become the worker the agent hands over. A job
    handed over before the preload is done ends it (the script imports what it needs itself):
    a node's first start does not wait for modules its script may never use."""
    from trainguard.core.procs import pause_gc, resume_gc  # only a pre-started process's

    sock = socket.socket(fileno=fd)
    pause_gc()  # the preload's objects live as long as the process: frozen once imported
    for name in filter(None, os.environ.pop(envvars.ZYGOTE_PRELOAD, "").split(",")):
        if select.select([sock], [], [], 0)[0]:
            break
        try:
            __import__(name)
        except Exception:  # the worker imports it itself (and reports the error)
            pass
    resume_gc()
    try:
        sock.sendall(b"R")
    except OSError:
        pass  # the agent handed us a job (and closed its end) before we were ready
    fds: list[int] = []
    (size,) = struct.unpack("!I", _recv_exact(sock, 4, fds))
    job = json.loads(_recv_exact(sock, size, fds))
    if len(fds) != 2:
        os._exit(ABORT_EXIT_CODE)
    for target, got in zip((1, 2), fds, strict=True):
        os.dup2(got, target)
        os.close(got)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    sock.close()


def chain_user_sitecustomize() -> None:
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


def main() -> None:
    """Everything the hook does, in order (see the module's docstring)."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HOOK_DIR]
    fd = os.environ.pop(envvars.ZYGOTE_FD, None)
    if fd is not None:
        try:
            _wait_for_job(int(fd))
        except BaseException:
            os._exit(ABORT_EXIT_CODE)
    _leave_pythonpath()
    run_entries(parse_entries(os.environ.pop(envvars.WORKER_HOOKS, None)))
    chain_user_sitecustomize()
