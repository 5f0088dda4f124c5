"""A pre-started worker process: imports the heavy modules, then waits to become a worker.

Started by the agent's :class:`trainguard.runtime.spare_pool.WarmPool` as
``python -u -m trainguard.runtime.warm_worker MOD[,MOD...] READY_FD``. It imports the listed
modules (torch, torch.distributed, ...) while nothing waits for it, writes one byte to
``READY_FD``, then reads one JSON line from stdin:
``{"argv": [...], "env": {...}, "stdout": path|null, "stderr": path|null}`` (what torch's
``SubprocessHandler`` would have started: ``python -u [-m] SCRIPT ARGS`` with that environment
and those log files), and runs the script as ``__main__`` in this process. Only its agent holds
the other end of its stdin: end of input without a spec (the pool closed, or the agent died,
kill -9 included) is exit 0. Not ``PR_SET_PDEATHSIG``: it fires when the *thread* that started
the process ends, and pools are filled from short-lived threads.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys


def main() -> None:
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
