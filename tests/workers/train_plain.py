"""examples/train_mlp.py without DistributedDataParallel, for tests whose subject is not DDP.

The same arguments, checkpoints (``tg.checkpoint``: resume from the newest, the memory tier every
step, disk every ``--ckpt-every`` steps), steps, chaos hooks and ``--fail-at-step`` kill -9 as
the example; the gradients are averaged with one gloo all-reduce per parameter instead of a DDP
wrapper. DDP's constructor imports torch._dynamo (~2 CPU s per worker start), and the suite is
CPU-bound: the tests that check the example itself (DDP included) still run the example.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import trainguard


def make_batch(step: int, rank: int, batch: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(batch, dim, generator=g)
    return x, x.sin().sum(dim=1, keepdim=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--ckpt-every", type=int, default=20)
    args = p.parse_args()

    tg = trainguard.init()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt}
    ckpt = None
    if args.ckpt_every > 0:
        ckpt = tg.checkpoint
        ckpt.config.every_steps = args.ckpt_every
        if ckpt.restore_or_init(state) and tg.rank == 0:
            print(f"resumed at step {tg.step_num}")

    loss = torch.zeros(())
    while tg.step_num < args.steps:
        if (
            tg.step_num == args.fail_at_step
            and tg.rank == args.fail_rank
            and tg.agent_restarts == 0
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = make_batch(tg.step_num, tg.rank, args.batch, args.dim)
        with tg.step(samples=args.batch):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            for param in model.parameters():
                dist.all_reduce(param.grad)
                param.grad /= world
            opt.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
        tg.log(loss=loss.item())
        if ckpt is not None:
            ckpt.maybe_save(tg.step_num, state)

    if ckpt is not None:
        ckpt.close()
    if tg.rank == 0:
        print(f"done: {args.steps} steps, final loss {loss.item():.6f}, run dir {tg.run_dir}")
    dist.barrier()  # every rank leaves together (pytorch/pytorch#179291)
    dist.destroy_process_group()
    tg.close()


if __name__ == "__main__":
    main()
