"""Test worker for the recovery policy: a gloo all-reduce per step under tg.step().

--crash-rank R --crash-at-step S   rank R exits with --crash-code at step S on EVERY attempt
                                   (a deterministic bug: a crash loop)
--ckpt-every K                     resume from tg.checkpoint, save every K steps and wait for
                                   the commit
--until-file F                     run until F exists (every rank stops at the same step)
Rank 0 writes <run_dir>/done (the attempt) at the end.
"""

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
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--step-s", type=float, default=0.02)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--crash-code", type=int, default=3)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--until-file", default=None)
    args = p.parse_args()

    tg = trainguard.init()
    dist.init_process_group("gloo")
    state = {"w": torch.zeros(8)}
    ckpt = tg.checkpoint if args.ckpt_every > 0 else None
    if ckpt is not None:
        ckpt.restore_or_init(state)  # sets tg.step_num
    until = Path(args.until_file) if args.until_file else None
    while tg.step_num < args.steps:
        if tg.rank == args.crash_rank and tg.step_num == args.crash_at_step:
            os._exit(args.crash_code)
        with tg.step():
            time.sleep(args.step_s)
            flag = torch.tensor([1.0 if until is not None and until.exists() else 0.0])
            dist.all_reduce(flag)
            state["w"] += 1
        if flag.item() > 0:
            break
        if ckpt is not None and tg.step_num % args.ckpt_every == 0:
            ckpt.save(tg.step_num, state).wait()
    if ckpt is not None:
        ckpt.close()
    if tg.rank == 0:
        (tg.run_dir / "done").write_text(str(tg.attempt))
    dist.barrier()
    dist.destroy_process_group()
    tg.close()


if __name__ == "__main__":
    main()
