"""The built-in tiny policies, built in code so that examples, tests and benchmarks download
nothing:

- ``tiny-gpt2``: a random-weight GPT-2 (2 layers, 32 wide) with a word-level tokenizer; the
  embedded engine's model.
- ``tiny-llama``: a random-weight Llama (hidden 128, 2 layers, 4 heads of 32, 2 KV heads,
  vocab 512, ~0.43 M parameters) with a byte-level BPE tokenizer trained here on a fixed
  corpus; the model a real engine (vLLM) serves, saved as a Hugging Face model directory
  (:func:`save_tiny_llama`) that the trainer and the engines load alike. Its head size (32) is
  the smallest vLLM's CPU attention supports.

The same ``seed`` gives the same initial weights in the trainer and in every engine; the
engines then take their weights from the trainer's weight store anyway.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "TINY_LLAMA",
    "TINY_MODEL",
    "WORDS",
    "digit_reward",
    "load_model",
    "save_tiny_llama",
    "tiny_gpt2",
    "tiny_llama",
    "tiny_llama_tokenizer",
    "tiny_tokenizer",
]

TINY_MODEL = "tiny-gpt2"
HF_CONFIG = "config.json"
"""A Hugging Face checkpoint directory's own configuration file (the model's, not the run's)."""

TINY_LLAMA = "tiny-llama"
TINY_LLAMA_FILES = (HF_CONFIG, "model.safetensors", "tokenizer.json", "tokenizer_config.json")
"""What a whole tiny-llama directory holds."""
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


_LLAMA_WORDS = ("please", "write", "digits", "now", "the", "a", "number", "and", "is", "of",
                "to", "in", "it", "you", "that", "one", "two", "three")  # fmt: skip


def _llama_corpus() -> list[str]:
    """The fixed corpus the tiny Llama's tokenizer is trained on (the task's prompts and a few
    words): the same merges on every machine."""
    out = [f"please write {i % 10} {(i // 10) % 10} now" for i in range(100)]
    w = list(_LLAMA_WORDS)
    out += [" ".join(w[i:] + w[:i]) for i in range(len(w))]
    return out


def tiny_llama_tokenizer() -> Any:
    """A byte-level BPE tokenizer (``<pad>`` 0, ``<eos>`` 1, no BOS) trained on a fixed corpus;
    training is deterministic, so every process builds the same vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_llama_corpus(), trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    out.padding_side = "left"
    return out


def tiny_llama(seed: int = 0) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def save_tiny_llama(path: str | os.PathLike[str], seed: int = 0) -> Path:
    """The tiny Llama and its tokenizer as a Hugging Face model directory at ``path`` (what
    ``from_pretrained`` and vLLM's ``--model`` load). The processes that need it at once (a
    trainer's ranks and its engines) build it one at a time, under a lock file beside it: the
    first builds it in a temporary directory and renames it into place, the others find it
    whole. A directory that is not whole (a builder killed midway) is built again."""
    dest = Path(path)
    if _whole_model_dir(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC  # never through a symlink
    lock = os.open(dest.parent / f".{dest.name}.lock", flags, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the descriptor is closed
        if _whole_model_dir(dest):
            return dest
        shutil.rmtree(dest, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        try:
            tiny_llama(seed).save_pretrained(tmp)
            tiny_llama_tokenizer().save_pretrained(tmp)
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        os.close(lock)
    return dest


def _whole_model_dir(d: Path) -> bool:
    return all((d / name).is_file() for name in TINY_LLAMA_FILES)


def load_model(name: str, seed: int = 0) -> tuple[Any, Any]:
    """``(model, tokenizer)``: the built-in ``tiny-gpt2`` or ``tiny-llama``, or a local Hugging
    Face model directory (``from_pretrained``; nothing is downloaded: ``local_files_only``)."""
    if name == TINY_MODEL:
        return tiny_gpt2(seed), tiny_tokenizer()
    if name == TINY_LLAMA:
        return tiny_llama(seed), tiny_llama_tokenizer()
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
