"""A Hugging Face ``Trainer`` job: a tiny random-weight GPT-2 (built from a config, nothing
downloaded) learns a fixed random token corpus, on CPU.

    trainguard run --standalone --nproc-per-node 2 examples/hf_trainer.py --steps 60

The one trainguard line is ``callbacks=[TrainGuardCallback()]`` (``--no-trainguard`` leaves it
out; under ``trainguard run`` it is then attached automatically unless
``TRAINGUARD_INTEGRATIONS_AUTO=0``). The script runs unchanged under ``torchrun`` and plain
``python``. It resumes from its newest checkpoint in ``--output-dir`` (HF's ``save_steps``);
with the callback, trainguard restores its own newer per-step snapshot on top.
``--fail-at-step N`` makes ``--fail-rank`` kill itself with SIGKILL when step N begins, on the
first attempt only. Dropout is off and the sampler is seeded: a resumed run ends with the
weights of a straight one. ``--out FILE`` saves rank 0's final weights.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from step_clock import StepClock, hf_callback
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

VOCAB, SEQ = 128, 32


class TokenData(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class FailAt(TrainerCallback):  # type: ignore[misc]
    """kill -9 of one rank when a step begins (first attempt only): a crash from inside."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_step_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if state.global_step == self.step and int(os.environ.get("RANK", "0")) == self.rank:
            if first:
                os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--output-dir", default=None, help="default: <run dir>/hf or ./hf-out")
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--no-trainguard", action="store_true", help="leave the callback out")
    p.add_argument("--out", default=None, help="save rank 0's final weights here")
    args = p.parse_args()

    from trainguard.core.contracts import envvars  # what `trainguard run` tells its workers

    run_dir = os.environ.get(envvars.RUN_DIR)
    out_dir = args.output_dir or (os.path.join(run_dir, "hf") if run_dir else "hf-out")
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    targs = TrainingArguments(
        output_dir=out_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=5,
        logging_steps=1,
        save_steps=args.save_steps,
        save_only_model=False,
        report_to=[],
        use_cpu=True,
        seed=0,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    callbacks: list[TrainerCallback] = []
    if not args.no_trainguard:
        from trainguard.integrations.hf import TrainGuardCallback

        callbacks.append(TrainGuardCallback())  # the one trainguard line
    if args.fail_at_step >= 0:
        callbacks.append(FailAt(args.fail_at_step, args.fail_rank))
    clock = StepClock()
    callbacks.append(hf_callback(clock))
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=TokenData(args.steps * args.batch * 2 + 64),
        callbacks=callbacks,
    )
    last = get_last_checkpoint(out_dir) if os.path.isdir(out_dir) else None
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=last)
    train_s = time.perf_counter() - t0
    if trainer.is_world_process_zero():
        if args.out:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
        print(
            f"done: {trainer.state.global_step} steps in {train_s:.2f} s, output {out_dir}",
            flush=True,
        )
        print(clock.line(), flush=True)


if __name__ == "__main__":
    main()
