"""TRL's ``GRPOTrainer`` generating on a rollout fleet through its ``rollout_func`` (trl 1.16,
experimental there): the tiny GPT-2 and the reward of ``examples/trl_grpo.py``, completions
from the engines of ``TRAINGUARD_ROLLOUT_URLS`` through :class:`trainguard.rl.RolloutClient`.

    TRAINGUARD_ROLLOUT_URLS=http://127.0.0.1:8101,http://127.0.0.1:8102 \\
        trainguard run --standalone --nproc-per-node 2 --tg-run-dir runs/trl \\
        examples/trl_grpo_fleet.py --steps 10

(the engines read the weight store of the same run directory: ``TRAINGUARD_RUN_DIR=runs/trl
python -m trainguard.rl.engine --port 8101``, or a ``rollout`` role). Before generating for a
new optimizer step, the main process publishes the policy as weight version ``global_step``
and pushes it to the engines; every process then waits until an engine serves that version
(on-policy). A failed request is retried on another engine; a batch that cannot be generated
raises (TRL would otherwise have no completion to train on). TRL's own server mode cannot be
used: it speaks ``trl vllm-serve``'s endpoints and syncs weights over NCCL. What this does not
have that ``examples/rl_fleet.py`` has: the prompt ledger (TRL's sampler and checkpoints own
the data position).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trainguard.rl import RolloutClient, WeightStore
from trainguard.rl.tiny import tiny_gpt2, tiny_tokenizer


def sevens(completions: list[str], **kw: object) -> list[float]:
    return [sum(w == "7" for w in t.split()) / max(1, len(t.split())) for t in completions]


class FleetRollout:
    """A TRL ``rollout_func``: one completion per prompt of the (already repeated) slice."""

    def __init__(self, client: RolloutClient, store: WeightStore, max_tokens: int) -> None:
        self.client, self.store, self.max_tokens = client, store, max_tokens
        self.version: int | None = None

    def _refit(self, trainer: Any) -> None:
        v = int(trainer.state.global_step)
        if v == self.version:
            return
        acc = trainer.accelerator
        if acc.is_main_process:
            model = acc.unwrap_model(trainer.model)
            self.store.publish(v, model.state_dict())
            self.client.sync_weights(v)
        acc.wait_for_everyone()
        self.client.set_policy_version(v)
        self.client.wait_serving(1, timeout=300)
        self.version = v

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        self._refit(trainer)
        groups = self.client.generate(prompts, n=1, max_tokens=self.max_tokens, logprobs=True)
        tok = trainer.processing_class
        comps = [g[0] for g in groups]
        return {
            "prompt_ids": [tok(p)["input_ids"] for p in prompts],
            "completion_ids": [c.token_ids for c in comps],
            "logprobs": [c.logprobs or [0.0] * len(c.token_ids) for c in comps],
        }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    run_dir = os.environ.get("TRAINGUARD_AGENT_RUN_DIR") or tempfile.mkdtemp(prefix="trl-fleet-")
    torch.manual_seed(0)
    model, tokenizer = tiny_gpt2(seed=0), tiny_tokenizer()
    tokenizer.padding_side = "left"
    init_dir = tempfile.mkdtemp(prefix="trl-init-")
    model.save_pretrained(init_dir)
    model.config._name_or_path = init_dir  # TRL builds the KL reference from the policy's path
    client = RolloutClient()
    rollout = FleetRollout(client, WeightStore(os.path.join(run_dir, "rl", "weights")), 8)
    gargs = GRPOConfig(
        output_dir=os.path.join(run_dir, "trl"),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        beta=0.04,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        disable_tqdm=True,
    )
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    prompts = Dataset.from_dict({"prompt": ["please write digits now"] * (args.steps * 8 + 64)})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=sevens,
        args=gargs,
        train_dataset=prompts,
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    trainer.train()
    client.close()
    if trainer.accelerator.is_main_process:
        print(
            f"done: {args.steps} steps, weight version {rollout.version}, failures {dict(client.failures)}"
        )


if __name__ == "__main__":
    main()
