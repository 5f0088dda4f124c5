"""A deterministic 2-process DDP job (gloo, CPU, seeded) using ``trainguard.init()``.

    trainguard run --standalone --nproc-per-node 2 examples/train_mlp.py --steps 100

The same script runs under torchrun and plain python. ``--out FILE`` saves the final parameters
(rank 0) for bitwise comparisons; ``--fail-at-step N`` makes ``--fail-rank`` kill itself with
SIGKILL at step N on the first attempt only (a real ``kill -9`` injected from inside).

Checkpoints go through ``tg.checkpoint``: resume from the newest checkpoint (the node's memory
tier under ``trainguard run``, else disk), save to the memory tier every step and to disk every
``--ckpt-every`` steps (0: no checkpointing) under ``TRAINGUARD_CHECKPOINT_DIR`` (default
``<run dir>/checkpoints``). One step counter: ``tg.step_num`` (the steps done), which the restore
sets and ``tg.step()`` advances; checkpoints are saved as of it. Batches are a function of the
step, so a resumed run ends bitwise-identical to a straight one. ``--out-optim FILE`` saves rank
0's optimizer state. ``--no-ddp`` averages the gradients with an all-reduce per parameter
instead of the DDP wrapper, whose constructor imports ``torch._dynamo`` (about 2 CPU seconds at
every start of a worker).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard


def make_batch(step: int, rank: int, batch: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(batch, dim, generator=g)
    y = x.sin().sum(dim=1, keepdim=True)
    return x, y


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", default=None, help="save final parameters (rank 0) to this file")
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--ckpt-every", type=int, default=20, help="disk checkpoint interval; 0: off")
    p.add_argument("--out-optim", default=None, help="save final optimizer state (rank 0) here")
    p.add_argument("--no-ddp", action="store_true", help="average gradients without DDP")
    p.add_argument("--ddp-ignore", default=None, help="a parameter DDP leaves out (e.g. 2.bias)")
    args = p.parse_args()

    tg = trainguard.init()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    if args.ddp_ignore:  # its gradient is not averaged: the replicas differ by design
        DDP._set_params_and_buffers_to_ignore_for_model(net, [args.ddp_ignore])
    model = net if args.no_ddp else DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    state = {"model": model, "optim": opt}
    ckpt = None
    if args.ckpt_every > 0:
        ckpt = tg.checkpoint  # local; the collective setup runs in restore_or_init (every rank)
        ckpt.config.every_steps = args.ckpt_every
        if ckpt.restore_or_init(state) and tg.rank == 0:  # sets tg.step_num
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
            if args.no_ddp:  # what DDP does: each gradient averaged over the ranks
                for param in net.parameters():
                    dist.all_reduce(param.grad)
                    param.grad /= dist.get_world_size()
            opt.step()
            if args.step_sleep:
                import time

                time.sleep(args.step_sleep)
        tg.log(loss=loss.item())
        if ckpt is not None:
            ckpt.maybe_save(tg.step_num, state)  # as of the steps done

    if args.out and tg.rank == 0:
        torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, args.out)
    if args.out_optim and tg.rank == 0:
        torch.save(opt.state_dict(), args.out_optim)
    if ckpt is not None:
        ckpt.close()
    if tg.rank == 0:
        print(f"done: {args.steps} steps, final loss {loss.item():.6f}, run dir {tg.run_dir}")
    # every rank leaves together (gloo's teardown can abort a process whose peer is already
    # gone, pytorch/pytorch#179291), without gloo's teardown deadlock: see its docstring
    trainguard.destroy_process_group()
    tg.close()


if __name__ == "__main__":
    main()
