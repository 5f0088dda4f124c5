"""Test worker (no trainguard import): records how it was started, then follows a plan.

Writes ``$DUMP_DIR/env_<restart>_<rank>.json`` (env, argv, cwd, ``__name__``, ``sys.path[0]``,
``sys.orig_argv``, interpreter flags), prints one line to stdout and one to stderr, then does
what ``PLAN`` says for this restart (``TORCHELASTIC_RESTART_COUNT``; 0 without an agent) on
rank ``PLAN_RANK`` (default 1; the other ranks exit 0):

PLAN    comma-separated ``<restart>:<action>``; actions: ``sleep`` (every rank sleeps, to be
        killed), ``raise`` (RuntimeError under torch's ``@record``: exit 1 and an error file),
        ``exit<N>`` (``sys.exit(N)``), ``exitmsg`` (``sys.exit("message")``: exit 1), ``ok``.
TORCH   ``0``: do not import torch (``@record`` is then a no-op), for the cheap pool tests.
"""

import json
import os
import sys
import time


def _record(fn):
    if os.environ.get("TORCH") == "0":
        return fn
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


@_record
def main() -> None:
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    out = os.environ["DUMP_DIR"]
    os.makedirs(out, exist_ok=True)
    dump = {
        "env": dict(os.environ),
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "cwd": os.getcwd(),
        "name": __name__,
        "path0": sys.path[0],
        "path": [p for p in sys.path if "_zygote" in p],
        "stdout_write_through": sys.stdout.write_through,
        "stdout_line_buffering": sys.stdout.line_buffering,
        "pid": os.getpid(),
    }
    path = os.path.join(out, f"env_{restart}_{rank}.json")
    with open(path + ".tmp", "w") as f:  # renamed in whole: the test reads it once it exists
        json.dump(dump, f)
    os.replace(path + ".tmp", path)
    print(f"out rank {rank} restart {restart}")
    print(f"err rank {rank} restart {restart}", file=sys.stderr)
    plan = dict(p.split(":") for p in os.environ.get("PLAN", "").split(",") if p)
    action = plan.get(str(restart), "ok")
    if action == "sleep":
        time.sleep(600)
    if rank != int(os.environ.get("PLAN_RANK", "1")):
        return
    # every rank of this restart has written its dump before the planned failure tears the
    # group down (a slow rank killed in the teardown would leave none)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
        os.path.exists(os.path.join(out, f"env_{restart}_{r}.json")) for r in range(world)
    ):
        time.sleep(0.02)
    if action == "raise":
        raise RuntimeError(f"planned failure at restart {restart}")
    if action.startswith("exit") and action[4:].isdigit():
        sys.exit(int(action[4:]))
    if action == "exitmsg":
        sys.exit(f"planned exit message at restart {restart}")


if __name__ == "__main__":
    main()
