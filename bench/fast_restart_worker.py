"""Worker for bench/fast_restart.py: a plain 2-process gloo DDP toy (no trainguard import).

With ``--tg-checkpoint`` the same toy checkpoints through trainguard instead of ``torch.save``
(``tg.checkpoint``: the node's memory tier every step, disk every ``--ckpt-every`` steps) and
resumes from the newest state any tier holds: the path that bounds the steps redone.

~50 ms steps (compute, then sleep to the step time), rank 0 checkpoints with ``torch.save``
every ``--ckpt-every`` steps, every rank resumes from the newest checkpoint. Each completed
step appends ``<steps done> <unix time> <pid> <generation>`` to ``OUT/steps_<rank>.log``
(generation: ``TORCHELASTIC_RESTART_COUNT``, which grows with every restart of the group).
An in-process example for the bench writes the same lines (its own generation counter).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--tg-checkpoint", action="store_true", help="checkpoint through trainguard")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    tg = None
    if args.tg_checkpoint:
        import trainguard

        tg = trainguard.init()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ckpt = out / "ckpt.pt"
    step = 0
    if tg is not None:
        state = {"model": model, "optim": opt}
        tg.checkpoint.config.every_steps = args.ckpt_every
        tg.checkpoint.restore_or_init(state)
        step = tg.step_num
    elif ckpt.exists():
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        step = state["step"]
    generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log = open(out / f"steps_{rank}.log", "a", buffering=1)  # noqa: SIM115
    while step < args.steps:
        t0 = time.monotonic()
        g = torch.Generator().manual_seed(1_000_003 * step + rank)
        x = torch.randn(16, 32, generator=g)
        loss = nn.functional.mse_loss(model(x), x.sin().sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if tg is not None:
            tg.step_num = step
            tg.checkpoint.maybe_save(step, state)
        rest = args.step_time - (time.monotonic() - t0)
        if rest > 0:
            time.sleep(rest)
        log.write(f"{step} {time.time():.6f} {os.getpid()} {generation}\n")
        if tg is None and rank == 0 and step % args.ckpt_every == 0:
            tmp = out / "ckpt.pt.tmp"
            torch.save(
                {"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step}, tmp
            )
            os.replace(tmp, ckpt)
    dist.barrier()
    if tg is not None:
        tg.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
