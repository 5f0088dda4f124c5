"""Repeat chosen test files N times under load, stopping at the first failure (``make
test-repeat``): how a test that passed once is shown to pass every time on a busy machine.

Each round runs the files as the suite runs them (``-n $TEST_WORKERS --dist loadgroup``),
beside ``--load`` processes that keep a core busy each (the suite's own jobs: a 2-core machine
running ``make test`` is never idle), so a test that depends on an idle machine fails here as
it would in the suite. The load runs at the suite's priority and is ended by its PIDs.

    python tests/services/repeat.py -n 20 tests/test_roles.py [more files or node ids]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def _burners(count: int) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        for _ in range(count)
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="test files or node ids")
    ap.add_argument("-n", "--times", type=int, default=20, help="rounds (default 20)")
    ap.add_argument("--load", type=int, default=2, help="busy processes beside it (default 2)")
    ap.add_argument("--workers", default=os.environ.get("TEST_WORKERS", "4"))
    args = ap.parse_args(argv)
    if args.times < 1 or args.load < 0:
        ap.error("-n must be >= 1 and --load >= 0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", str(args.workers), "--dist", "loadgroup"]
    cmd += ["-p", "no:cacheprovider", *args.files]
    load = _burners(args.load)
    passed = 0
    try:
        for i in range(1, args.times + 1):
            t0 = time.monotonic()
            rc = subprocess.run(cmd, check=False).returncode
            took = time.monotonic() - t0
            if rc != 0:
                print(f"test-repeat: round {i} failed (rc {rc}, {took:.0f} s); "
                      f"{passed}/{args.times} passed before it", flush=True)  # fmt: skip
                return 1
            passed += 1
            print(f"test-repeat: round {i}/{args.times} passed ({took:.0f} s)", flush=True)
    finally:
        for p in load:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    print(f"test-repeat: {passed}/{args.times} passed under a load of {args.load}: "
          f"{' '.join(args.files)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
