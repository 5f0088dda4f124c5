"""A DDP toy run as torchft replica groups (one process per replica group, gloo on CPU).

    # one terminal per replica group (each its own rendezvous); the first starts a lighthouse
    REPLICA_GROUP_ID=0 trainguard run --ft --standalone --nproc-per-node 1 examples/ft_ddp.py
    REPLICA_GROUP_ID=1 trainguard run --ft --standalone --nproc-per-node 1 examples/ft_ddp.py

``--plain-torchft`` runs the same loop on torchft's own DDP/optimizer wrappers without
trainguard (the baseline of bench/ft.py; start ``torchft_lighthouse`` yourself). With
``--step-log FILE`` every committed step appends ``{"t", "step", "pid", "rg"}`` to FILE; with
``--out DIR`` the final weights go to ``DIR/rg<id>_final.json``; ``--stop-file`` lets a
harness end both groups at the same step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-time", type=float, default=0.05, help="simulated compute (s)")
    ap.add_argument("--ckpt-every", type=int, default=0, help="trainguard disk checkpoints")
    ap.add_argument("--plain-torchft", action="store_true")
    ap.add_argument("--step-log", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--stop-file", default=None, help="a file holding a step to end at (read every step)"
    )
    args = ap.parse_args()
    rg = int(os.environ.get("REPLICA_GROUP_ID", "0"))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    tg = None
    if args.plain_torchft:
        from datetime import timedelta

        from torchft.ddp import DistributedDataParallel
        from torchft.manager import Manager
        from torchft.optim import OptimizerWrapper
        from torchft.process_group import ProcessGroupGloo

        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
            min_replica_size=1,
            load_state_dict=lambda sd: (
                model.load_state_dict(sd["model"]),
                opt.load_state_dict(sd["optim"]),
            ),
            state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
            replica_id=f"plain_rg{rg}",
            timeout=timedelta(seconds=10),
        )
        ddp: nn.Module = DistributedDataParallel(manager, model)
        optimizer: torch.optim.Optimizer = OptimizerWrapper(manager, opt)
        current_step = manager.current_step
    else:
        import trainguard

        tg = trainguard.init()
        ft = tg.ft_wrap(model, opt)
        manager, ddp, optimizer, current_step = ft.manager, ft.model, ft.optimizer, ft.current_step

    log = open(args.step_log, "a", buffering=1) if args.step_log else None  # noqa: SIM115
    stop_at = args.steps
    while current_step() < stop_at:
        step = current_step()
        g = torch.Generator().manual_seed(step * 1000 + rg)
        x = torch.randn(32, 16, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()

        def one_step(x: torch.Tensor = x, y: torch.Tensor = y) -> float:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            time.sleep(args.step_time)  # the compute; gradients are allreduced in backward
            loss.backward()
            optimizer.step()
            return float(loss)

        if tg is not None:
            with tg.step(step):
                loss = one_step()
            tg.log(loss=loss, step=step)
            done = current_step()
            if args.ckpt_every and done % args.ckpt_every == 0 and done != step:
                tg.checkpoint.save(
                    done,
                    {"model": model.state_dict(), "optim": opt.state_dict()},
                )
        else:
            loss = one_step()
        if args.stop_file and os.path.exists(args.stop_file):
            stop_at = int(Path(args.stop_file).read_text() or stop_at)
        if log is not None and current_step() > step:
            log.write(
                json.dumps(
                    {
                        "t": time.time(),
                        "step": current_step(),
                        "pid": os.getpid(),
                        "rg": rg,
                        "participants": manager.num_participants(),
                    }
                )
                + "\n"
            )
    if args.out:
        weights = [p.detach().flatten().tolist() for p in model.parameters()]
        path = Path(args.out) / f"rg{rg}_final.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step": current_step(), "pid": os.getpid(), "w": weights}))
    if tg is not None:
        if args.ckpt_every:
            tg.checkpoint.wait()
        tg.close()
    else:
        manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
