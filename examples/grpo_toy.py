"""GRPO on CPU: a tiny GRU policy learns to write digits that sum to a target.

    trainguard run --standalone --nproc-per-node 2 examples/grpo_toy.py --steps 150

The prompt is a target t (5..20); the policy writes up to ``--max-len`` tokens from
{0..9, EOS}; the reward is 1 when the digits sum to t, else 0 (verifiable, no reward model).
Each step: sample ``--group`` responses per prompt with the current (old) policy, compute
group-relative advantages ``(r - mean_group) / (std_group + eps)``, then ``--inner`` epochs of
the clipped surrogate with a k3 KL penalty to the frozen initial policy (the reference).
Gradients are averaged across ranks (gloo). Logged per step through trainguard: reward
mean/std/min/max, kl, entropy, clip_fraction, response length mean/max, loss, grad_norm, lr;
spans ``rollout``, ``reward``, ``optimize``. ``--ckpt FILE`` saves/restores (rank 0 writes);
``--fail-at-step N`` SIGKILLs ``--fail-rank`` at step N on the first attempt.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import trainguard

DIGITS = 10
EOS = 10
BOS = 11
VOCAB = 12  # inputs: 0..9, EOS, BOS; outputs: 0..9, EOS
T_MIN, T_MAX = 5, 20


class Policy(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.target = nn.Embedding(T_MAX + 1, hidden)
        self.tok = nn.Embedding(VOCAB, hidden)
        self.cell = nn.GRUCell(hidden, hidden)
        self.head = nn.Linear(hidden, DIGITS + 1)

    def logits(self, targets: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits for responses ``tokens`` [N, L] → [N, L, 11]."""
        h = torch.tanh(self.target(targets))
        prev = torch.full_like(targets, BOS)
        out = []
        for i in range(tokens.shape[1]):
            h = self.cell(self.tok(prev), h)
            out.append(self.head(h))
            prev = tokens[:, i]
        return torch.stack(out, dim=1)

    @torch.no_grad()
    def sample(self, targets: torch.Tensor, max_len: int, gen: torch.Generator) -> torch.Tensor:
        h = torch.tanh(self.target(targets))
        prev = torch.full_like(targets, BOS)
        done = torch.zeros_like(targets, dtype=torch.bool)
        toks = []
        for _ in range(max_len):
            h = self.cell(self.tok(prev), h)
            probs = torch.softmax(self.head(h), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            nxt = torch.where(done, torch.full_like(nxt, EOS), nxt)
            toks.append(nxt)
            done |= nxt == EOS
            prev = nxt
        return torch.stack(toks, dim=1)


def response_mask(tokens: torch.Tensor) -> torch.Tensor:
    """1 for tokens up to and including the first EOS."""
    is_eos = (tokens == EOS).int()
    before = torch.cumsum(is_eos, dim=1) - is_eos  # EOS seen strictly before
    return (before == 0).float()


def rewards(targets: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    digits = torch.where(tokens < DIGITS, tokens, torch.zeros_like(tokens))
    total = (digits * mask).sum(dim=1)
    return (total == targets).float()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--prompts", type=int, default=16, help="prompts per rank per step")
    p.add_argument("--group", type=int, default=16, help="responses per prompt")
    p.add_argument("--max-len", type=int, default=4)
    p.add_argument("--inner", type=int, default=2, help="optimisation epochs per rollout")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--beta", type=float, default=0.02, help="KL penalty weight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default=None, help="checkpoint file (saved by rank 0)")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()

    tg = trainguard.init()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    policy = Policy()
    reference = copy.deepcopy(policy).requires_grad_(False)
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    if args.ckpt and os.path.exists(args.ckpt):
        # this example keeps its own (rank 0) checkpoint file; with tg.checkpoint the restore
        # sets tg.step_num itself. Either way "step" is the number of steps done.
        state = torch.load(args.ckpt, weights_only=True)
        policy.load_state_dict(state["policy"])
        reference.load_state_dict(state["reference"])
        opt.load_state_dict(state["opt"])
        tg.step_num = int(state["step"])
        tg.events.emit("checkpoint_restored", step=tg.step_num)
    gen = torch.Generator().manual_seed(args.seed * 1000 + tg.rank * 7919 + tg.step_num)

    while tg.step_num < args.steps:
        if (
            tg.step_num == args.fail_at_step
            and tg.rank == args.fail_rank
            and tg.agent_restarts == 0
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        n = args.prompts * args.group
        # tokens: the padded response tokens the step processes (prompts x group x max_len)
        with tg.step(samples=n, tokens=n * args.max_len, flops="auto") as num:
            with tg.span("rollout"):
                t = torch.randint(T_MIN, T_MAX + 1, (args.prompts,), generator=gen)
                targets = t.repeat_interleave(args.group)
                tokens = policy.sample(targets, args.max_len, gen)
                mask = response_mask(tokens)
                with torch.no_grad():
                    old_logits = policy.logits(targets, tokens)
                    old_lp = token_logprobs(old_logits, tokens)
                    ref_lp = token_logprobs(reference.logits(targets, tokens), tokens)
                    probs = torch.softmax(old_logits, -1)
                    ent = -(probs * torch.log(probs.clamp_min(1e-12))).sum(-1)
                    entropy = (ent * mask).sum() / mask.sum()
            with tg.span("reward"):
                r = rewards(targets, tokens, mask)
                grouped = r.view(args.prompts, args.group)
                adv = (grouped - grouped.mean(1, keepdim=True)) / (
                    grouped.std(1, keepdim=True) + 1e-4
                )
                adv = adv.view(-1, 1)
            with tg.span("optimize"):
                for _ in range(args.inner):
                    lp = token_logprobs(policy.logits(targets, tokens), tokens)
                    ratio = torch.exp(lp - old_lp)
                    clipped = torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
                    pg = -torch.min(ratio * adv, clipped * adv)
                    d = ref_lp - lp
                    kl_tok = torch.exp(d) - d - 1
                    loss = ((pg + args.beta * kl_tok) * mask).sum() / mask.sum()
                    opt.zero_grad()
                    loss.backward()
                    if distributed:
                        for prm in policy.parameters():
                            dist.all_reduce(prm.grad, op=dist.ReduceOp.AVG)
                    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                    opt.step()
                clip_frac = (((ratio - 1).abs() > args.clip).float() * mask).sum() / mask.sum()
                kl = (kl_tok * mask).sum() / mask.sum()
            if args.step_sleep:
                time.sleep(args.step_sleep)
        lengths = mask.sum(1)
        tg.log(
            step=num,
            reward=r.mean().item(),
            reward_std=r.std().item(),
            reward_min=r.min().item(),
            reward_max=r.max().item(),
            kl=kl.item(),
            entropy=entropy.item(),
            clip_fraction=clip_frac.item(),
            response_length=lengths.mean().item(),
            response_length_max=lengths.max().item(),
            loss=loss.item(),
            grad_norm=grad_norm.item(),
            lr=args.lr,
        )
        if args.ckpt and tg.rank == 0 and tg.step_num % args.ckpt_every == 0:
            t0 = time.perf_counter()
            tmp = args.ckpt + ".tmp"
            torch.save(
                {
                    "policy": policy.state_dict(),
                    "reference": reference.state_dict(),
                    "opt": opt.state_dict(),
                    "step": tg.step_num,  # the steps done = where to resume
                },
                tmp,
            )
            os.replace(tmp, args.ckpt)
            stall = time.perf_counter() - t0
            tg.events.emit("checkpoint_saved", step=tg.step_num, stall_s=round(stall, 6))
            tg.log(step=num, checkpoint_stall_s=stall)

    if tg.rank == 0:
        print(f"done: {args.steps} steps, last reward {r.mean().item():.3f}, run dir {tg.run_dir}")
    if distributed:
        dist.destroy_process_group()
    tg.close()


if __name__ == "__main__":
    main()
