"""Reproducible sampling: one random stream per sample, seeded from what the sample is.

A rollout sample is named by the run's seed, the epoch, the prompt's data-set id and the
sample's index in its group. :func:`prompt_seed` turns the first three into the seed a
request carries for that prompt (the engine contract's ``seed``, one per prompt), and sample
``j`` of the prompt draws from a generator seeded with ``seed + j`` (the convention vLLM
follows for ``n`` > 1). The samples of a step regenerated after a resume, on another engine,
in another batch, are therefore the same tokens: what makes a run through faults end with
the weights of the fault-free run.

:class:`SeededSampler` is the embedded engine's sampler: a ``transformers`` logits processor
that applies temperature and top-p itself and draws each row from its own
``torch.Generator`` (``generate`` then decodes greedily the one token it left), recording
the log-probability of each drawn token under the distribution it was drawn from. Rows are
independent of one another; the engine generates the ``n`` rows of one prompt as a batch of
their own (same length, no padding), so nothing else in a batch changes their numbers.
Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["SEED_MAX", "SeededSampler", "prompt_seed", "request_seed", "sample_seed"]

SEED_MAX = 2**63 - 1
"""Seeds are non-negative 63-bit integers (what ``torch.Generator.manual_seed`` and vLLM take)."""


def prompt_seed(run_seed: int, epoch: int, prompt_id: int) -> int:
    """The request seed of prompt ``prompt_id`` in ``epoch`` of the run seeded ``run_seed``:
    a 63-bit hash, so that seeds of different prompts (and their ``+ j`` samples) never
    meet."""
    digest = hashlib.blake2b(f"{run_seed}:{epoch}:{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (SEED_MAX >> 4)


def request_seed(seed: int, index: int) -> int:
    """The seed of prompt ``index`` of a request (or a batch) seeded with one int ``seed``."""
    return prompt_seed(seed, -1, index)


def sample_seed(seed: int, index: int) -> int:
    """The generator seed of sample ``index`` of a prompt requested with ``seed``."""
    return (seed + index) & SEED_MAX


_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _uniform(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """One uniform in [0, 1) per row: SplitMix64 of (row seed, step), in int64 tensor
    arithmetic (wrapping, logical shifts), so every row of every step is one vector op."""
    import torch

    def shr(z: torch.Tensor, k: int) -> torch.Tensor:
        return (z >> k) & ((1 << (64 - k)) - 1)

    def const(x: int) -> torch.Tensor:
        return torch.tensor(_signed(x % (1 << 64)), dtype=torch.int64)

    z = seeds * const(_GOLDEN) + const((step + 1) * _GOLDEN)
    z = (z ^ shr(z, 30)) * const(_MIX1)
    z = (z ^ shr(z, 27)) * const(_MIX2)
    z = z ^ shr(z, 31)
    return shr(z, 11).to(torch.float64) / float(1 << 53)


class SeededSampler:
    """A logits processor drawing row ``b`` from a random stream of its own, seeded
    ``seeds[b]`` (temperature, then top-p, as ``transformers``' warpers do; the draw: the
    inverse CDF at a counter-based uniform of (seed, step)); pass it with
    ``do_sample=False``. ``logprobs[b]``: the log-probability of each drawn token."""

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float) -> None:
        import torch

        if temperature <= 0:
            raise ValueError("SeededSampler samples: temperature must be > 0")
        self.temperature = temperature
        self.top_p = top_p
        self.seeds = torch.tensor([int(s) for s in seeds], dtype=torch.int64)
        self.step = 0
        self.logprobs: list[list[float]] = [[] for _ in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        logits = scores.float() / self.temperature
        if self.top_p < 1.0:  # keep the smallest set whose probability reaches top_p
            order = torch.sort(logits, descending=True, dim=-1)
            probs = torch.softmax(order.values, -1)
            drop = (probs.cumsum(-1) - probs) >= self.top_p
            logits = logits.scatter(-1, order.indices, order.values.masked_fill(drop, -torch.inf))
        logp = torch.log_softmax(logits, -1)
        cdf = logp.double().exp().cumsum(-1)
        u = _uniform(self.seeds, self.step)[:, None] * cdf[:, -1:]
        tok = torch.searchsorted(cdf, u, right=True).clamp_max(cdf.shape[-1] - 1)
        while True:  # never a token of probability 0 (u at the top of a flat run of the CDF)
            zero = logp.gather(-1, tok) == -torch.inf
            if not bool(zero.any()):
                break
            tok = torch.where(zero, tok - 1, tok)
        self.step += 1
        for b, lp in enumerate(logp.gather(-1, tok).squeeze(-1).tolist()):
            self.logprobs[b].append(lp)
        return torch.full_like(scores, -torch.inf).scatter(-1, tok, 0.0)
