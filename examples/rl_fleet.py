"""GRPO with a rollout fleet: trainer ranks under gloo, generation on separate engine processes.

    # the engines: a rollout role under `trainguard run` (TRAINGUARD_ROLLOUT_URLS is set for the
    # trainer), or started by hand, one per port:
    TRAINGUARD_RUN_DIR=runs/rl python -m trainguard.rl.engine --port 8101 &
    TRAINGUARD_RUN_DIR=runs/rl python -m trainguard.rl.engine --port 8102 &
    TRAINGUARD_ROLLOUT_URLS=http://127.0.0.1:8101,http://127.0.0.1:8102 \\
        trainguard run --standalone --nproc-per-node 2 --tg-run-dir runs/rl examples/rl_fleet.py

The policy is the tiny random-weight GPT-2 of ``examples/trl_grpo.py`` (built in code, nothing
downloaded), or with ``--model tiny-llama`` the tiny Llama that vLLM engines serve
(``python -m trainguard.rl.engines.vllm``; built into ``RUN_DIR/rl/models/tiny-llama``, the
directory the engines load too). Prompt ``i`` reads ``please write A B now``; the verifiable reward is the share of
the completion's words equal to the digit A (``trainguard.rl.tiny.digit_reward``, in-process,
or on reward servers: ``--reward-urls`` or a ``reward`` role, the ``trainguard.rl.reward``
client retrying on another server). Each step every rank takes the same global batch
of prompt positions from the :class:`trainguard.rl.PromptLedger`, generates ``--group``
completions for its share through the :class:`trainguard.rl.RolloutClient` (retries on
another engine; a batch is complete or the step raises, never a made-up sample), computes
group-relative advantages, and takes one policy-gradient step with a k3 KL penalty to the
frozen initial policy. A group is trained complete or dropped whole, never padded
(``--group-policy shrink``: shrunk to at least 2 survivors, their advantages over them
alone); a member staler than ``--max-staleness`` at the version it trains into does not
survive; each sample's staleness and the dropped groups by reason are recorded
(``rollout_samples_trained`` events, drawn by ``trainguard report``). Rank 0 then publishes
weight version ``step + 1`` to the weight store and pushes it to the engines (on-policy: ``--max-staleness 0``).

Resume is lossless: the ledger (prompt position, pending prompts) and the weight version are
in the ``tg.checkpoint`` state saved every step (memory tier); rank 0 appends each committed
step's prompts to ``RUN_DIR/rl/consumed.jsonl`` (the audit trail of exactly-once training).
A restarted trainer reattaches to the running engines, refits them to its restored version
when theirs differs, and goes on. Every sample is seeded from (``--seed``, the epoch, the
prompt id, its index in the group) and dropout per step: an on-policy run through faults
ends with the weights of the fault-free run with the same seed, bit for bit. Each step's log
record has ``samples_sha``, a digest of the prompt ids and token ids the rank trained on, to
compare two runs sample by sample.

TRL: ``GRPOTrainer`` (trl 1.16) generates through vLLM in server mode with TRL's own
``VLLMClient`` (``/generate/``, ``/init_communicator/``, ``/update_named_param/`` of
``trl vllm-serve``, weights over an NCCL group) or through a ``rollout_func``. Its server mode
needs those TRL endpoints (not this engine contract) and NCCL; a ``rollout_func`` can call
:meth:`RolloutClient.generate`, but the trainer's weights then reach the engines only through
the weight store (TRL has no hook after its optimizer step other than a callback), and TRL
retries nothing: this example drives the loop itself.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

import trainguard
from trainguard.rl import (
    Completion,
    ConsumedLog,
    PromptLedger,
    RolloutClient,
    RolloutConfig,
    WeightStore,
)
from trainguard.rl.client import REWARD_URLS_ENV
from trainguard.rl.groups import GROUP_POLICIES, SampleRecord, settle
from trainguard.rl.reward import RewardClient
from trainguard.rl.sampling import prompt_seed
from trainguard.rl.tiny import TINY_LLAMA, digit_reward, load_model, save_tiny_llama
from trainguard.rl.verify import fingerprint

FINGERPRINT = ["please write 3 7 now 3 3 3", "write digits 1 2 now 9 0 1", "now now 5 <eos>"]
"""Fixed texts whose log-probs tell one weight version from another (trainguard.rl.verify)."""


def prompt_text(i: int) -> str:
    return f"please write {i % 10} {(i // 10) % 10} now"


def seq_logprobs(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, start: int
) -> torch.Tensor:
    """Per-token log-probabilities of ids[:, start:] (completion tokens) → [B, L]; positions
    count from each row's first real token, as the engine's generate does."""
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, start - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, start:, None]).squeeze(-1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--model",
        default="tiny-gpt2",
        help="tiny-gpt2 (the embedded engine's) or tiny-llama (a vLLM fleet's, built into "
        "RUN_DIR/rl/models/ as the engines build it)",
    )
    p.add_argument("--prompts", type=int, default=64, help="prompts in the data set")
    p.add_argument("--batch", type=int, default=8, help="prompts per step (all ranks)")
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--max-staleness", type=int, default=0)
    p.add_argument(
        "--group-policy",
        choices=GROUP_POLICIES,
        default="whole",
        help="a group with a lost member (failed, stale at training, repeated): dropped whole, "
        "or shrunk to its survivors (at least 2, advantages over them alone); never padded",
    )
    p.add_argument(
        "--drop-failed-groups",
        action="store_true",
        help="a rollout request out of attempts drops its groups (counted) instead of "
        "failing the step",
    )
    p.add_argument("--request-timeout", type=float, default=30.0)
    p.add_argument("--max-attempts", type=int, default=6, help="per rollout request")
    p.add_argument(
        "--serving-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for a first serving engine (vLLM starts in minutes on a CPU)",
    )
    p.add_argument("--urls", default=None, help="default: $TRAINGUARD_ROLLOUT_URLS")
    p.add_argument(
        "--reward-urls",
        default=os.environ.get(REWARD_URLS_ENV),
        help="reward servers (python -m trainguard.rl.reward --function "
        "trainguard.rl.tiny:digit_reward); default: $TRAINGUARD_REWARD_URLS, else in-process",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the run's seed: initial policy, prompt order, every sample's random stream",
    )
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()

    tg = trainguard.init()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    name = args.model
    if name == TINY_LLAMA:  # the directory the engines serve: one tokenizer, one architecture
        name = str(save_tiny_llama(tg.run_dir / "rl" / "models" / TINY_LLAMA, seed=0))
    policy, tok = load_model(name, seed=args.seed)
    reference = copy.deepcopy(policy).requires_grad_(False)
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    ledger = PromptLedger(args.prompts, seed=args.seed)
    state = {"model": policy, "optim": opt, "ledger": ledger}
    ckpt = tg.checkpoint
    resumed = ckpt.restore_or_init(state)  # sets tg.step_num; the weight version = steps done
    version = tg.step_num

    store = WeightStore(tg.run_dir / "rl" / "weights")
    urls = args.urls.split(",") if args.urls else None
    client = RolloutClient(
        urls,
        config=RolloutConfig(
            max_staleness=args.max_staleness,
            request_timeout_s=args.request_timeout,
            max_attempts=args.max_attempts,
            drop_failed_groups=args.drop_failed_groups,
            group_policy=args.group_policy,
        ),
        events=tg.events.emit,
        # verified refit: an engine is routed a version once its log-probs of these texts
        # match what the trainer computed when it wrote the version
        fingerprints=lambda v: store.meta(v).get("fingerprint"),
    )

    def write(v: int) -> None:
        store.publish(v, policy.state_dict(), fingerprint=fingerprint(policy, tok, FINGERPRINT))

    consumed = ConsumedLog(tg.run_dir / "rl" / "consumed.jsonl")
    scorer = RewardClient(args.reward_urls.split(",")) if args.reward_urls else None

    def score(ids: list[int], comps: list[list[Completion]]) -> list[torch.Tensor]:
        """Each group's rewards: from the reward servers when there are some (retried on
        another after a failure; an error after the cap, never a made-up reward)."""
        prompts = [prompt_text(i) for i, group in zip(ids, comps, strict=True) for _ in group]
        texts = [c.text for group in comps for c in group]
        if scorer is not None:
            flat = scorer.score(prompts, texts)
        else:
            flat = [digit_reward(p, t) for p, t in zip(prompts, texts, strict=True)]
        out, at = [], 0
        for group in comps:
            out.append(torch.tensor(flat[at : at + len(group)]))
            at += len(group)
        return out

    def publish(v: int, *, reattach: bool = False) -> dict[str, float]:
        """Rank 0 publishes and pushes version v; every rank learns who confirmed. On
        ``reattach`` (a (re)start), the running engines keep their weights when they and
        the store already hold v."""
        info: list[object] = [None]
        if tg.rank == 0:
            t0 = time.perf_counter()
            cur = store.current()
            versions = {e["version"] for e in client.engines().values() if e["state"] != "dead"}
            if reattach and cur is not None and cur.version == v and versions == {v}:
                client.set_policy_version(v)
                info = [{"confirmed": client.urls_at(v), "publish_s": 0.0, "sync_s": 0.0,
                         "missed": 0, "timeout_s": 0.0, "refit": False}]  # fmt: skip
            else:
                write(v)
                pub = time.perf_counter() - t0
                res = client.sync_weights(v, rewrite=lambda: write(v))
                info = [{"confirmed": res.confirmed, "publish_s": pub, "sync_s": res.duration_s,
                         "missed": len(res.missed), "timeout_s": res.timeout_s, "refit": True}]  # fmt: skip
        if world > 1:
            dist.broadcast_object_list(info, src=0)
        got = info[0]
        assert isinstance(got, dict)
        if tg.rank != 0:
            client.assume_version(got["confirmed"], v)
        return {"weight_publish_s": got["publish_s"], "weight_sync_s": got["sync_s"],
                "weight_sync_missed": got["missed"], "weight_sync_timeout_s": got["timeout_s"],
                "weight_refit": int(got["refit"])}  # fmt: skip

    # reattach: the engines keep running through a trainer restart; refit them to our version
    # only when theirs (or the store's) differs
    before = {u: e["version"] for u, e in client.engines().items() if e["state"] != "dead"}
    attach = publish(version, reattach=True)
    tg.events.emit("rl_trainer_attached", version=version, resumed_step=resumed,
                   refit=bool(attach["weight_refit"]), engines_before=before)  # fmt: skip
    client.wait_serving(1, timeout=args.serving_timeout)

    def generate(positions: list[int]) -> list[list[Completion]]:
        """Each sample seeded from (run seed, epoch, prompt id, its index in the group): a
        step regenerated after a resume gets the same completions from any engine."""
        ids = [ledger.prompt_id(g) for g in positions]
        seeds = [
            prompt_seed(args.seed, g // args.prompts, i)
            for g, i in zip(positions, ids, strict=True)
        ]
        return client.generate([prompt_text(i) for i in ids], n=args.group, seed=seeds,
                               max_tokens=args.max_tokens, temperature=1.0)  # fmt: skip

    # async (--max-staleness >= 1): the next batch is generated while this one trains; its
    # positions are pending in the ledger (in the checkpoint), handed out again after a restart
    prefetch: tuple[list[int], Future[list[list[Completion]]]] | None = None
    pool = ThreadPoolExecutor(max_workers=1)
    record = SampleRecord(tg.events.emit, tg.rank, bound=args.max_staleness)
    while tg.step_num < args.steps:
        if tg.step_num == args.fail_at_step and tg.rank == args.fail_rank and tg.attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if prefetch is not None:
            positions, pending = prefetch
            prefetch = None
        else:
            positions, pending = ledger.take(args.batch), None
        mine = positions[tg.rank :: world]
        ids = [ledger.prompt_id(g) for g in mine]
        with tg.step(samples=len(ids) * args.group) as step:
            torch.manual_seed(prompt_seed(args.seed, step, -1 - tg.rank))  # dropout, per step
            with tg.span("rollout"):
                comps = pending.result() if pending is not None else generate(mine)
            if args.max_staleness > 0 and step + 1 < args.steps:
                nxt = ledger.take(args.batch)
                prefetch = (nxt, pool.submit(generate, nxt[tg.rank :: world]))
            # a group is trained complete (or shrunk to >= 2 survivors) or dropped whole: its
            # members judged against the version this update trains into (step)
            cfg = client.config
            settled = settle(comps, n=args.group, train_version=step,
                             max_staleness=cfg.max_staleness, policy=cfg.group_policy,
                             min_survivors=cfg.min_group_survivors)  # fmt: skip
            kept_ids = [ids[gi] for gi, _ in settled.kept]
            kept = [group for _, group in settled.kept]
            with tg.span("reward"):
                rewards = score(kept_ids, kept) if kept else []
                # group-relative, over the members trained (a shrunk group's survivors)
                adv = [(r - r.mean()) / (r.std() + 1e-4) for r in rewards]
            with tg.span("optimize"):
                rows, advs = [], []
                start = max((len(tok(prompt_text(i))["input_ids"]) for i in kept_ids), default=1)
                for i, group, a in zip(kept_ids, kept, adv, strict=True):
                    prompt_ids = tok(prompt_text(i))["input_ids"]
                    for c, ai in zip(group, a, strict=False):
                        out = c.token_ids  # with the EOS token when it stopped there
                        rows.append((start - len(prompt_ids), prompt_ids, out))
                        advs.append(float(ai))
                length = max((len(o) for _, _, o in rows), default=0) or 1
                ids_t = torch.full((len(rows), start + length), tok.pad_token_id)
                attn = torch.zeros_like(ids_t)
                resp = torch.zeros((len(rows), length))
                for r, (pad, pr, out) in enumerate(rows):  # left-padded prompt, then completion
                    ids_t[r, pad:start] = torch.tensor(pr)
                    attn[r, pad : start + len(out)] = 1
                    if out:
                        ids_t[r, start : start + len(out)] = torch.tensor(out)
                        resp[r, : len(out)] = 1
                lp = seq_logprobs(policy, ids_t, attn, start)
                with torch.no_grad():
                    ref_lp = seq_logprobs(reference, ids_t, attn, start)
                d = ref_lp - lp
                kl_tok = torch.exp(d) - d - 1
                a_t = torch.tensor(advs)[:, None]
                denom = resp.sum().clamp_min(1)
                loss = ((-a_t * lp + args.beta * kl_tok) * resp).sum() / denom
                if not rows:  # every group of this rank dropped: no gradient of its own
                    loss = sum((prm * 0).sum() for prm in policy.parameters())
                # sampled at temperature 1 from these weights: -E[log p] estimates the entropy
                entropy = -(lp.detach() * resp).sum() / denom
                opt.zero_grad()
                loss.backward()
                if world > 1:
                    for prm in policy.parameters():
                        if prm.grad is not None:
                            dist.all_reduce(prm.grad, op=dist.ReduceOp.AVG)
                opt.step()
                kl = (kl_tok * resp).sum() / denom
            version = step + 1
            sync = publish(version)
            if args.step_sleep:
                time.sleep(args.step_sleep)
        ledger.commit(positions)
        flat = settled.samples
        # staleness: the version this update trained (step) - the version that generated it
        stale = [step - c.weight_version for c in flat]
        # a trained sample is a real generation: an engine's answer, with a version in the bound
        real = sum(
            bool(c.engine) and 0 <= s <= args.max_staleness
            for c, s in zip(flat, stale, strict=True)
        )
        lengths = [len(c.token_ids) for c in flat] or [0]
        every = torch.cat(rewards) if rewards else torch.zeros(1)
        # each sample's staleness, each group's size, the dropped groups by reason
        groups = record.trained(step, step, settled)
        # what this rank trained on, in one digest: two runs trained on the same samples
        # (a run through faults and the fault-free run) log the same digest for each step
        trained = [
            [i, [c.token_ids for c in group]] for i, group in zip(kept_ids, kept, strict=True)
        ]
        samples_sha = hashlib.sha256(json.dumps(trained).encode()).hexdigest()[:16]
        tg.log(step=step, reward=every.mean().item(), reward_std=every.std().item(),
               kl=kl.item(), entropy=entropy.item(), loss=loss.item(),
               response_length=sum(lengths) / len(lengths), response_length_max=max(lengths),
               staleness_mean=groups.pop("staleness_mean", 0.0),
               staleness_max=groups.pop("staleness_max", 0), **groups,
               weight_version=version, samples_trained=len(rows),
               samples_real=real, samples_sha=samples_sha, **sync, **client.take_metrics())  # fmt: skip
        if tg.rank == 0:
            consumed.append(step, positions, [ledger.prompt_id(g) for g in positions],
                            attempt=tg.attempt, version=version,
                            staleness_max=max(stale, default=0))  # fmt: skip
        ckpt.maybe_save(tg.step_num, state)

    if tg.rank == 0:
        print(
            f"done: {args.steps} steps, weight version {version}, run dir {tg.run_dir}", flush=True
        )
    ckpt.close()
    pool.shutdown(cancel_futures=True)
    client.close()
    if world > 1:
        trainguard.destroy_process_group()
    tg.close()


if __name__ == "__main__":
    main()
