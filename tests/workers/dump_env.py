"""Test worker: dumps its env and argv to $DUMP_DIR, then behaves as asked by env knobs.

DUMP_DIR          where to write env_<restart>_<rank>.json
EXIT_CODE         exit with this code (default 0) ...
EXIT_UNTIL        ... only while TORCHELASTIC_RESTART_COUNT < EXIT_UNTIL (default: always)
EXIT_RANK         ... only on this global rank (default: every rank)
RAISE_MESSAGE     raise RuntimeError(message) under @record instead of exiting
SLEEP_S           sleep this long before exiting (e.g. to be killed)

A rank that exits with a code or raises first waits for every rank's dump of this attempt (each
rank prints its lines before it dumps), so no launcher stops a rank before its lines are out.

torch is imported only when RAISE_MESSAGE asks for torch's ``@record`` (an error file), on the
ranks that raise: every other path is torch-free, so a worker starts in milliseconds instead of an import of torch.
"""

import json
import os
import sys
import time


def main() -> None:
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    out = os.environ["DUMP_DIR"]
    os.makedirs(out, exist_ok=True)
    print(f"hello from rank {rank} restart {restart}", flush=True)
    print(f"stderr line from rank {rank}", file=sys.stderr, flush=True)
    # written whole or not at all, after the lines above: the tests poll for these files while
    # the worker runs
    path = os.path.join(out, f"env_{restart}_{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(
            {"env": dict(os.environ), "argv": sys.argv, "pid": os.getpid(), "cwd": os.getcwd()}, f
        )
    os.replace(path + ".tmp", path)
    if os.environ.get("SLEEP_S"):
        time.sleep(float(os.environ["SLEEP_S"]))
    active = restart < int(os.environ.get("EXIT_UNTIL", "1000000"))
    on_rank = os.environ.get("EXIT_RANK") in (None, "", str(rank))
    code = int(os.environ.get("EXIT_CODE", "0"))
    if active and on_rank and (os.environ.get("RAISE_MESSAGE") or code):
        # a failing rank waits for every rank's lines (their dumps): the launcher stops the
        # others when it fails, and the log files are compared between launchers
        world = int(os.environ.get("WORLD_SIZE", "1"))
        peers = [os.path.join(out, f"env_{restart}_{r}.json") for r in range(world)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(map(os.path.exists, peers)):
            time.sleep(0.01)
    if active and on_rank and os.environ.get("RAISE_MESSAGE"):
        raise RuntimeError(os.environ["RAISE_MESSAGE"])
    if active and on_rank and code:
        sys.exit(code)


if __name__ == "__main__":
    # only a rank that raises needs the error file (EXIT_RANK unset: every rank raises)
    if os.environ.get("RAISE_MESSAGE") and os.environ.get("EXIT_RANK") in (
        None,
        "",
        os.environ.get("RANK", "0"),
    ):
        from torch.distributed.elastic.multiprocessing.errors import record

        record(main)()
    else:
        main()
