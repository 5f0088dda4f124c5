"""Verified refit: an engine is routed version ``v`` only once trainguard checked that it holds
``v``, outside the engine's own claims.

Two checks, both against what the trainer wrote for ``v`` (:class:`~trainguard.rl.weights.
WeightStore` metadata):

- the **digest**: the SHA-256 of the weight file as written; an engine checks the file
  against it before loading (:meth:`WeightStore.check_digest`), so a truncated or changed
  file is never loaded;
- the **fingerprint**: teacher-forced log-probabilities of a few fixed texts, computed by the
  trainer from the weights it publishes (:func:`fingerprint`); the client asks the engine for
  the same texts' prompt log-probs (a completion request with ``prompt_logprobs``) and
  compares (:func:`compare`). A half-loaded, wrong or garbled model answers other numbers.

The tolerance must let the same weights computed by another process through and stop any
other version. Measured on ``examples/rl_fleet.py``'s tiny policy (learning rate 1e-3, its
fingerprint texts, versions 28-30 of a bench run): the engine against the trainer on the same
weights 0.0 (same CPU, each text alone); consecutive versions 0.021 and 0.022 (the largest
log-prob difference); half of a version's tensors loaded over the previous version 0.0084;
the initial weights against version 30 0.63. The default tolerance, 1e-3, is 8× below the
nearest wrong model. An engine on other kernels (a GPU in bf16 against a CPU trainer in
fp32) differs by more even on the right weights: measure both distances the same way and
set ``tolerance`` between them, or use a larger learning rate per version.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainguard.core.contracts.engine import MalformedAnswer, parse_prompt_logprobs

__all__ = ["DEFAULT_TOLERANCE", "compare", "fingerprint", "fingerprint_request"]

DEFAULT_TOLERANCE = 1e-3


def fingerprint(
    model: Any, tokenizer: Any, texts: Sequence[str], tolerance: float = DEFAULT_TOLERANCE
) -> dict[str, Any]:
    """``{"texts", "token_ids", "logprobs", "tolerance"}``: each text alone (no padding), the
    log-probability of each of its tokens after the first given those before it, the model
    in eval mode (no dropout; its mode is restored)."""
    import torch

    was_training = model.training
    model.eval()
    ids_out: list[list[int]] = []
    lps_out: list[list[float]] = []
    try:
        with torch.no_grad():
            for text in texts:
                ids = tokenizer(text, return_tensors="pt")["input_ids"]
                if ids.shape[1] < 2:
                    raise ValueError(f"fingerprint text {text!r}: give at least two tokens")
                logits = model(input_ids=ids).logits[0, :-1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
                ids_out.append(ids[0].tolist())
                lps_out.append(lp.tolist())
    finally:
        model.train(was_training)
    return {"texts": list(texts), "token_ids": ids_out, "logprobs": lps_out,
            "tolerance": tolerance}  # fmt: skip


def fingerprint_request(fp: dict[str, Any]) -> dict[str, Any]:
    """The ``/v1/completions`` body asking an engine for the fingerprint texts' log-probs."""
    return {"prompt": list(fp["texts"]), "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": 0, "refit_check": True}  # fmt: skip


def compare(fp: dict[str, Any], answer: Any, version: int) -> tuple[str | None, float]:
    """``(None, max |Δ|)`` when the engine's answer (parsed by the engine contract's
    :func:`~trainguard.core.contracts.engine.parse_prompt_logprobs`) matches the fingerprint
    of ``version`` within its tolerance, else ``(what differed, max |Δ|)``."""
    texts = fp["texts"]
    try:
        got = parse_prompt_logprobs(answer, expected=len(texts))
    except MalformedAnswer as e:
        return f"the answer is malformed ({e.detail})", float("inf")
    if got.weight_version != version:
        return f"the answer was computed by version {got.weight_version}, not {version}", float(
            "inf"
        )
    worst, where = 0.0, ""
    for i, ((ids, lps), want) in enumerate(zip(got.prompts, fp["logprobs"], strict=True)):
        if len(lps) != len(want) + 1:
            return f"text {i}: {len(lps)} prompt log-probs for {len(want) + 1} tokens", float("inf")
        if ids is not None and ids != fp["token_ids"][i]:
            return f"text {i}: tokenized differently ({ids[:8]}…)", float("inf")
        for k, (g, w) in enumerate(zip(lps[1:], want, strict=True)):
            d = abs((g if g is not None else float("inf")) - w)
            if d > worst:
                worst, where = d, f"text {i} token {k + 1}: {g} against {w:.6f}"
    tol = float(fp.get("tolerance", DEFAULT_TOLERANCE))
    if worst > tol:
        return f"log-probs differ by {worst:.3g} > {tol:g} ({where})", worst
    return None, worst
