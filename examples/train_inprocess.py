"""The deterministic 2-process DDP toy (gloo, CPU) written as a function for in-process restarts.

    trainguard run --standalone --nproc-per-node 2 examples/train_inprocess.py --steps 200

Training runs in ``trainguard.run(train)``: when a rank dies, the agent starts a replacement
for it only, the surviving ranks re-enter ``train`` in their own process (same PID) and every
rank resumes from the node's memory tier, which snapshots every step (at most one step redone).

After each completed step every rank writes one line to stdout (one ``write``, so two ranks
sharing the launcher's stdout never interleave inside a line)::

    TG_STEP {"step": 41, "rank": 0, "pid": 1234, "gen": 1, "time": 1718000000.123456}

``step`` is the step just completed (0-based), ``gen`` the in-process generation (0 until the
first in-process restart), ``time`` the wall clock after it: the time from a kill to the next
line is the recovery time, and a step printed twice was redone. ``--step-sleep`` makes a step
~50 ms (the benchmarks' toy); ``--out FILE`` saves rank 0's final parameters for bitwise
comparisons; ``--fail-at-step N`` makes ``--fail-rank`` kill itself with SIGKILL when it is
about to run step N in generation 0 (tests kill by PID from outside instead). Batches are a
function of the step, so a restarted run ends bitwise identical to a straight one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard


def make_batch(step: int, rank: int, batch: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(batch, dim, generator=g)
    y = x.sin().sum(dim=1, keepdim=True)
    return x, y


def train(tg: Any, args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(nn.Linear(args.dim, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt}
    ckpt = tg.checkpoint
    if args.ckpt_every:
        ckpt.config.every_steps = args.ckpt_every
    ckpt.restore_or_init(state)  # the memory tier's newest common step; sets tg.step_num
    loss = torch.zeros(())
    while tg.step_num < args.steps:
        if tg.step_num == args.fail_at_step and tg.rank == args.fail_rank and tg.generation == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = make_batch(tg.step_num, tg.rank, args.batch, args.dim)
        with tg.step(samples=args.batch) as step:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
        done = {"step": step, "rank": tg.rank, "pid": os.getpid(), "gen": tg.generation}
        done["time"] = round(time.time(), 6)
        os.write(1, f"TG_STEP {json.dumps(done)}\n".encode())
        ckpt.maybe_save(tg.step_num, state)  # memory tier every step; disk every --ckpt-every
    if args.out and tg.rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, args.out)
    ckpt.close()
    return float(loss.item())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--step-sleep", type=float, default=0.05, help="extra seconds per step")
    p.add_argument("--ckpt-every", type=int, default=0, help="disk checkpoint interval; 0: off")
    p.add_argument("--out", default=None, help="save final parameters (rank 0) to this file")
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=1)
    args = p.parse_args()

    tg = trainguard.init()
    loss = trainguard.run(train, args)
    if tg.rank == 0:
        os.write(
            1,
            f"done: {args.steps} steps, final loss {loss:.6f}, generation {tg.generation}, "
            f"pid {os.getpid()}\n".encode(),
        )
    tg.close()


if __name__ == "__main__":
    main()
