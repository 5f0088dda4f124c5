"""Worker for bench/teardown.py and its test: on the first attempt rank 1 fails (exit 1) while
rank 0 is inside a long step; on the next attempt every rank records when it started.

It uses trainguard's checkpoints, so trainguard's preemption handlers are installed (a first
SIGTERM is a preemption notice that waits for the next step boundary)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import trainguard


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="directory for the timing files")
    p.add_argument("--step-s", type=float, default=120.0, help="rank 0's long step")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    if restart > 0:  # the restarted group starts here (before any collective can hang)
        (out / f"started_{restart}_{rank}").write_text(repr(time.time()))
    dist.init_process_group("gloo")
    tg = trainguard.init()
    state = {"w": torch.zeros(4)}
    tg.checkpoint.restore_or_init(state)  # collective setup: preemption handlers installed
    if restart > 0:
        dist.barrier()
        tg.close()
        dist.destroy_process_group()
        return
    if tg.rank == 1:
        time.sleep(1.0)  # rank 0 is inside its step by now
        (out / "failed_at").write_text(repr(time.time()))
        os._exit(1)  # a crash: no interpreter teardown (gloo would wait for rank 0)
    with tg.step():
        time.sleep(args.step_s)  # a long step (on a GPU: a collective whose peer died)


if __name__ == "__main__":
    main()
