"""A PyTorch Lightning job: a small MLP regression on a fixed random data set, on CPU, with
``ModelCheckpoint`` (every ``--save-steps`` steps, ``save_last``) and ``ckpt_path="last"``.

    trainguard run --standalone --nproc-per-node 2 examples/lightning_trainer.py --steps 80

The one trainguard line is ``callbacks=[..., TrainGuardCallback()]`` (``--no-trainguard``
leaves it out; under ``trainguard run`` it is then attached automatically unless
``TRAINGUARD_INTEGRATIONS_AUTO=0``). The script runs unchanged under ``torchrun`` and plain
``python``. ``--fail-at-step N`` makes ``--fail-rank`` kill itself with SIGKILL when step N
begins, on the first attempt only.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from step_clock import StepClock, lightning_callback
from torch import nn

DIM = 32


class Regressor(L.LightningModule):
    def __init__(self, fail_at: int = -1, fail_rank: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 128), nn.Tanh(), nn.Linear(128, 1))
        self.fail_at, self.fail_rank = fail_at, fail_rank

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        if (
            self.global_step == self.fail_at
            and self.global_rank == self.fail_rank
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> object:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--output-dir", default=None, help="default: <run dir>/lightning or ./pl-out")
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--no-trainguard", action="store_true", help="leave the callback out")
    args = p.parse_args()

    from trainguard.core.contracts import envvars  # what `trainguard run` tells its workers

    run_dir = os.environ.get(envvars.RUN_DIR)
    out_dir = args.output_dir or (os.path.join(run_dir, "lightning") if run_dir else "pl-out")
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1234)
    n = args.steps * args.batch * 2 + 64  # one epoch holds every step (2 ranks)
    x = torch.randn(n, DIM, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sin().sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=False)
    callbacks: list[L.Callback] = [
        ModelCheckpoint(dirpath=out_dir, every_n_train_steps=args.save_steps, save_last=True)
    ]
    if not args.no_trainguard:
        from trainguard.integrations.lightning import TrainGuardCallback

        callbacks.append(TrainGuardCallback())  # the one trainguard line
    clock = StepClock()
    callbacks.append(lightning_callback(clock))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1"))
        // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "auto",
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    module = Regressor(args.fail_at_step, args.fail_rank)
    t0 = time.perf_counter()
    trainer.fit(module, loader, ckpt_path="last")
    train_s = time.perf_counter() - t0
    if trainer.is_global_zero:
        print(f"done: {trainer.global_step} steps in {train_s:.2f} s, output {out_dir}", flush=True)
        print(clock.line(), flush=True)


if __name__ == "__main__":
    main()
