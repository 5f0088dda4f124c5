"""The built-in tiny policy: a random-weight GPT-2 (2 layers, 32 wide) with a word-level
tokenizer built in code, so that examples, tests and benchmarks download nothing.

The same ``seed`` gives the same initial weights in the trainer and in every engine; the
engines then take their weights from the trainer's weight store anyway.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_MODEL", "WORDS", "digit_reward", "load_model", "tiny_gpt2", "tiny_tokenizer"]

TINY_MODEL = "tiny-gpt2"
WORDS = ["<pad>", "<eos>", "<unk>", *map(str, range(10)), "write", "digits", "please", "now"]


def tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    out.padding_side = "left"
    return out


def tiny_gpt2(seed: int = 0) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(WORDS), n_positions=64, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config)


def load_model(name: str, seed: int = 0) -> tuple[Any, Any]:
    """``(model, tokenizer)``: the built-in ``tiny-gpt2``, or a local Hugging Face model
    directory (``from_pretrained``; nothing is downloaded: ``local_files_only``)."""
    if name == TINY_MODEL:
        return tiny_gpt2(seed), tiny_tokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def digit_reward(prompt: str, completion: str) -> float:
    """The tiny task's verifiable reward: prompt ``please write A B now`` asks for the digit A;
    the reward is the share of the completion's words equal to it (0 for an empty one)."""
    words = prompt.split()
    target = words[2] if len(words) > 2 else ""
    out = completion.split()
    return sum(w == target for w in out) / max(1, len(out))
