"""A deterministic 2-process DDP toy with injectable faults: kill -9, hang, NaN loss.

    trainguard run --standalone --nproc-per-node 2 examples/fault_toy.py --steps 200 \\
        --nan-at 120 --kill-at 60 --hang-at 90

Used by the rollback and goodput tests and by ``bench/goodput.py``; runs the same under
torchrun. Batches are a function of the step, so a run that rolls back and skips a window ends
bitwise equal to a run that skipped that window from the start (``--skip A-B``, done by the
script itself, not by trainguard).

Faults, each once per run (marker files in ``--state-dir``), on ``--fault-rank``:
``--kill-at S`` SIGKILLs itself at step S; ``--hang-at S`` sleeps forever inside step S (its
heartbeat thread keeps beating: a real hang); ``--nan-at S`` poisons rank 0's batch of step S
for good (bad data: every visit of step S gives a NaN loss). ``--ctl DIR`` takes the same
faults from a harness instead: it writes ``DIR/fault`` = "<seq> hang|nan" (a kill it does
itself with the PIDs in ``DIR/pid_<rank>``).

``--timing FILE`` (rank 0) appends one JSON line per step, measured by the script itself:
step, start and end time, loss, and a hash of the parameters before and after the step; the
tests and the benchmark rebuild from them which executions the final weights descend from
(productive time) independently of trainguard's accounting.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

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


def params_hash(model: nn.Module) -> str:
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def once(state_dir: Path, name: str) -> bool:
    """True the first time ``name`` is asked for in this run (an atomic marker file)."""
    try:
        os.close(os.open(state_dir / f"fault_{name}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


class Control:
    """Faults from a harness (``--ctl``): ``DIR/fault`` holds "<seq> <kind>"."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.dir = directory
        self.rank = rank
        self._mtime = 0.0
        self.bad_steps: set[int] = set()
        (directory / f"pid_{rank}").write_text(str(os.getpid()))
        self._load_bad()

    def _load_bad(self) -> None:
        try:
            self.bad_steps = {int(x) for x in (self.dir / "bad_steps").read_text().split()}
        except (OSError, ValueError):
            pass

    def poll(self, step: int, fault_rank: int) -> str | None:
        try:
            st = os.stat(self.dir / "fault")
        except FileNotFoundError:
            return None
        if st.st_mtime == self._mtime:
            return None
        self._mtime = st.st_mtime
        try:
            seq, kind = (self.dir / "fault").read_text().split()
        except ValueError:
            return None
        if kind == "nan" and self.rank == 0 and once(self.dir, f"{seq}_nan"):
            self.bad_steps.add(step)  # this step's data is bad from now on
            with open(self.dir / "bad_steps", "a") as f:
                f.write(f"{step}\n")
            return "nan"
        if kind == "hang" and self.rank == fault_rank and once(self.dir, f"{seq}_hang"):
            return "hang"
        return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--ckpt-every", type=int, default=20, help="disk checkpoint interval")
    p.add_argument("--out", default=None, help="save final parameters (rank 0) to this file")
    p.add_argument("--skip", default=None, help="A-B: skip the data of steps A..B (reference)")
    p.add_argument("--nan-at", type=int, default=-1)
    p.add_argument("--nan-from", type=int, default=-1, help="every step from here is bad")
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--hang-at", type=int, default=-1)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--state-dir", default=None, help="fault markers (default: the run dir)")
    p.add_argument("--ctl", default=None, help="harness control directory")
    p.add_argument("--timing", default=None, help="rank 0: per-step timing (JSON lines)")
    p.add_argument("--pg-timeout", type=float, default=1800.0, help="gloo collective timeout")
    args = p.parse_args()

    tg = trainguard.init()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    state_dir = Path(args.state_dir or tg.run_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    ctl = Control(Path(args.ctl), tg.rank) if args.ctl else None
    skip = tuple(int(x) for x in args.skip.split("-")) if args.skip else None
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(nn.Linear(args.dim, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt}
    ckpt = tg.checkpoint
    ckpt.config.every_steps = args.ckpt_every
    ckpt.restore_or_init(state)
    timing = None
    if args.timing and tg.rank == 0:
        timing = os.open(args.timing, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    while tg.step_num < args.steps:
        if skip and skip[0] <= tg.step_num <= skip[1]:
            tg.step_num += 1  # the reference run skips the window by itself
            continue
        n = tg.step_num
        fault = ctl.poll(n, args.fault_rank) if ctl else None
        mine = tg.rank == args.fault_rank
        if mine and n == args.kill_at and once(state_dir, f"kill_{n}"):
            Path(state_dir, f"killed_at_{n}").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        hang = fault == "hang" or (mine and n == args.hang_at and once(state_dir, f"hang_{n}"))
        x, y = make_batch(n, tg.rank, args.batch, args.dim)
        bad = (
            n == args.nan_at or 0 <= args.nan_from <= n or (ctl is not None and n in ctl.bad_steps)
        )
        if tg.rank == 0 and bad:
            x[0, 0] = float("nan")
        before = params_hash(model) if timing is not None else ""
        t0 = time.time()
        with tg.step(samples=args.batch):
            if hang:
                Path(state_dir, f"hang_started_{n}").write_text(str(time.time()))
                time.sleep(3600)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
        t1 = time.time()
        value = loss.item()
        if timing is not None:
            line = {"step": n, "t0": t0, "t1": t1, "loss": repr(value), "before": before,
                    "after": params_hash(model), "attempt": tg.attempt}  # fmt: skip
            os.write(timing, (json.dumps(line) + "\n").encode())
        tg.log(loss=value)
        ckpt.maybe_save(tg.step_num, state)  # a loss anomaly on any rank rolls back here

    if args.out and tg.rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, args.out)
    ckpt.close()
    if tg.rank == 0:
        print(f"done: {args.steps} steps, skipped {tg.skip_ranges}, run dir {tg.run_dir}")
    trainguard.destroy_process_group()  # leave together (pytorch/pytorch#179291), no deadlock
    tg.close()


if __name__ == "__main__":
    main()
