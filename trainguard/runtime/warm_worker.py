"""A pre-started worker process: imports the heavy modules, then waits to become a worker.

Started by the agent's :class:`trainguard.runtime.warm.WarmPool` as
``python -u -m trainguard.runtime.warm_worker MOD[,MOD...] READY_FD``. It imports the listed
modules, writes one byte to ``READY_FD``
(torch, torch.distributed, ...) while nothing waits for it, then reads one JSON line from stdin:
``{"argv": [...], "env": {...}, "stdout": path|null, "stderr": path|null}`` (what torch's
``SubprocessHandler`` would have started: ``python -u [-m] SCRIPT ARGS`` with that environment
and those log files), and runs the script as ``__main__`` in this process. Until then it dies
with its agent (``PR_SET_PDEATHSIG``); afterwards it is a worker like any other. End of input
without a spec (the agent closed the pool): exit 0.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import signal
import sys


def _pdeathsig(sig: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    parent = os.getppid()
    _pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:  # the agent died before the line above
        os._exit(1)
    for name in (sys.argv[1] if len(sys.argv) > 1 else "").split(","):
        if name:
            try:
                importlib.import_module(name)
            except Exception:  # the script imports it again and reports the error itself
                pass
    if len(sys.argv) > 2:  # tell the pool we are warm (one byte on the pipe it gave us)
        ready = int(sys.argv[2])
        try:
            os.write(ready, b"1")
            os.close(ready)
        except OSError:
            pass
    line = sys.stdin.readline()
    if not line.strip():
        return
    spec = json.loads(line)
    _pdeathsig(0)  # a worker outlives its agent, as a freshly spawned one does
    os.environ.clear()
    os.environ.update(spec["env"])
    for fd, path in ((1, spec.get("stdout")), (2, spec.get("stderr"))):
        if path:
            target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    argv = list(spec["argv"])
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
