"""A TRL ``GRPOTrainer`` job: a tiny random-weight GPT-2 (built from a config) with a tiny
word-level tokenizer built in code (nothing downloaded) learns to write the digit 7, on CPU.

    trainguard run --standalone --nproc-per-node 2 examples/trl_grpo.py --steps 30

The reward is the share of 7s among the completion's words. ``beta`` > 0, so TRL computes the
KL to the reference model. The one trainguard line is ``callbacks=[TrainGuardCallback()]``
(``--no-trainguard`` leaves it out; under ``trainguard run`` it is then attached automatically
unless ``TRAINGUARD_INTEGRATIONS_AUTO=0``). The script runs unchanged under ``torchrun``. It
resumes from its newest checkpoint in ``--output-dir``; ``--fail-at-step N`` makes
``--fail-rank`` kill itself with SIGKILL when step N begins, on the first attempt only.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time

import torch
from datasets import Dataset
from step_clock import StepClock, hf_callback
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOConfig, GRPOTrainer

WORDS = ["<pad>", "<eos>", "<unk>", *map(str, range(10)), "write", "digits", "please", "now"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def sevens(completions: list[str], **kw: object) -> list[float]:
    """Share of the completion's words that are "7"."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w == "7" for w in words) / max(1, len(words)))
    return out


class FailAt(TrainerCallback):  # type: ignore[misc]
    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_step_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if state.global_step == self.step and int(os.environ.get("RANK", "0")) == self.rank:
            if first:
                os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--output-dir", default=None, help="default: <run dir>/trl or ./trl-out")
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--no-trainguard", action="store_true", help="leave the callback out")
    args = p.parse_args()

    from trainguard.core.contracts import envvars  # what `trainguard run` tells its workers

    run_dir = os.environ.get(envvars.RUN_DIR)
    out_dir = args.output_dir or (os.path.join(run_dir, "trl") if run_dir else "trl-out")
    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    config = GPT2Config(
        vocab_size=len(WORDS), n_positions=64, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    # TRL builds the KL reference model from the policy's path: a local copy of the random init
    init_dir = tempfile.mkdtemp(prefix="trl-init-")
    model.save_pretrained(init_dir)
    model.config._name_or_path = init_dir
    prompts = Dataset.from_dict({"prompt": ["please write digits now"] * (args.steps * 8 + 64)})
    gargs = GRPOConfig(
        output_dir=out_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        beta=0.04,
        learning_rate=1e-3,
        logging_steps=1,
        save_steps=args.save_steps,
        report_to=[],
        use_cpu=True,
        seed=0,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
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
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=sevens,
        args=gargs,
        train_dataset=prompts,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    last = get_last_checkpoint(out_dir) if os.path.isdir(out_dir) else None
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=last)
    train_s = time.perf_counter() - t0
    if trainer.is_world_process_zero():
        print(
            f"done: {trainer.state.global_step} steps in {train_s:.2f} s, output {out_dir}",
            flush=True,
        )
        print(clock.line(), flush=True)


if __name__ == "__main__":
    main()
