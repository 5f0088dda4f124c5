"""``python gated_run.py GATE trainguard-args...``: import torch and trainguard's launcher now,
run ``trainguard ARGS`` once the file GATE exists (a real agent whose start does not depend on
how long an interpreter takes to import torch on a loaded machine)."""

import sys
import time
from pathlib import Path

import torch  # noqa: F401  (the slow part of an agent's start)

import trainguard.runtime.launcher  # noqa: F401
from trainguard.cli.main import main

if __name__ == "__main__":
    gate = Path(sys.argv[1])
    deadline = time.monotonic() + 600
    while not gate.exists():
        if time.monotonic() > deadline:
            sys.exit(f"gated_run: {gate} never appeared")
        time.sleep(0.05)
    main(sys.argv[2:])
