"""A plain torch.distributed script (no trainguard import, no ``@record``) that fails on purpose,
for failure attribution tests and bench/fleet.py.

``--fault``:
- ``shape`` (every rank): multiplies tensors of mismatched shapes at step ``--at-step``;
- ``shape-rank0``: the same on rank 0 only (the others wait in their next all-reduce);
- ``flaky``: rank 0 raises a ``ValueError`` in the first attempt only, then trains;
- ``oom``: every rank raises torch's ``OutOfMemoryError`` with CUDA's wording;
- ``kill``: rank 0 SIGKILLs itself in the first attempt only; ``stop``: rank 0 SIGSTOPs itself in
  the first attempt only (the hang detector ends it); ``nan``: rank 0 raises
  ``FloatingPointError`` (a non-finite loss) in the first attempt only; ``none``: trains.

Each step is one all-reduce and ``--step-s`` of sleep. Ranks write their pid to
``pids/rank_<R>``; rank 0 appends a line to ``starts`` each time it starts (restarts = lines - 1).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist


def step(i: int, fault: str, rank: int, first: bool) -> None:
    if fault == "shape" or (fault == "shape-rank0" and rank == 0):
        a, b = torch.ones(3, 4), torch.ones(5, 6)
        torch.matmul(a, b)  # RuntimeError: mat1 and mat2 shapes cannot be multiplied
    if fault == "oom":
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
            "79.11 GiB of which 3.12 GiB is free."
        )
    if first and rank == 0:
        if fault == "flaky":
            raise ValueError("flaky input on the first attempt")
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if fault == "nan":
            raise FloatingPointError(f"loss is nan at step {i}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="shape")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--at-step", type=int, default=0)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--pg-timeout-s", type=float, default=90.0)
    a = p.parse_args()
    from datetime import timedelta

    if os.environ.get("RANK", "0") == "0":  # every start counts, before anything can fail
        with open("starts", "a") as f:
            f.write(f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\n")

    # bounded: torchrun's restarted workers were seen waiting in gloo's init here for its
    # default 30 min (the same script and timeout run under both launchers)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout_s))
    rank = dist.get_rank()
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    Path("pids").mkdir(exist_ok=True)
    Path(f"pids/rank_{rank}").write_text(str(os.getpid()))
    t = torch.ones(4)
    for i in range(a.steps):
        if i == a.at_step:
            step(i, a.fault, rank, first)
        dist.all_reduce(t)
        time.sleep(a.step_s)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
