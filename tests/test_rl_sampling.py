"""Reproducible sampling in the embedded engine's generation (in-process, no server: the
served path is tests/test_rl_replay.py's): a seeded sample is the same tokens and log-probs
whatever else is in the batch, padding included, and different seeds give different samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.rl.engine import BadRequest, Engine, EngineConfig, _Job, _Sampling
from trainguard.rl.sampling import _uniform, prompt_seed, request_seed


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    e = Engine(EngineConfig(weights_dir=Path(tmp_path_factory.mktemp("w"))))
    e.build()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in e.model.parameters():  # away from the near-uniform random init
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    e.version = 0
    return e


def _gen(e: Engine, prompts: list[str], seed: Any, n: int = 4, **kw: Any) -> list[Any]:
    s = _Sampling(
        max_tokens=kw.get("max_tokens", 8), temperature=kw.get("temperature", 1.0),
        top_p=kw.get("top_p", 1.0), n=n, seed=seed, logprobs=0,
    )  # fmt: skip
    job = _Job(prompts, s)
    e._generate([job])
    assert job.result is not None
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in job.result["choices"]]


def test_uniforms_are_splitmix64_of_seed_and_step() -> None:
    mask = (1 << 64) - 1

    def splitmix(x: int) -> int:
        z = (x + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    seeds = [0, 3, 2**62 + 5, 2**63 - 1]
    got = _uniform(torch.tensor(seeds, dtype=torch.int64), 4).tolist()
    want = [(splitmix((s * 0x9E3779B97F4A7C15 + 4 * 0x9E3779B97F4A7C15) & mask) >> 11) / 2**53
            for s in seeds]  # fmt: skip
    assert got == want
    u = _uniform(torch.arange(20000, dtype=torch.int64), 0)
    assert 0.49 < float(u.mean()) < 0.51 and float(u.min()) >= 0 and float(u.max()) < 1


def test_seeded_sample_does_not_depend_on_the_batch(engine: Engine) -> None:
    a, b = prompt_seed(7, 0, 3), prompt_seed(7, 0, 4)
    alone = _gen(engine, ["please write 3 1 now"], [a])
    # beside another prompt of the same length, and one of another length (padding)
    beside = _gen(engine, ["please write 4 2 now", "please write 3 1 now", "write 9"], [b, a, 11])
    assert beside[4:8] == alone
    others = [f"please write {i} 2 now" for i in range(8)]  # 32 rows first: another batch
    assert _gen(engine, [*others, "please write 3 1 now"], [*range(8), a])[32:] == alone
    assert _gen(engine, ["please write 3 1 now"], [a], top_p=0.6) != alone
    assert _gen(engine, ["please write 3 1 now"], [b]) != alone  # another seed, other tokens
    # the four samples of one prompt are four streams
    assert len({tuple(ids) for ids, _ in alone}) > 1
    # an int seed: prompt k of the request is seeded request_seed(seed, k)
    assert _gen(engine, ["please write 3 1 now"], 9) == _gen(
        engine, ["please write 3 1 now"], [request_seed(9, 0)]
    )


def test_seeded_logprobs_are_those_of_the_drawn_tokens(engine: Engine) -> None:
    (ids, lps), *_ = _gen(engine, ["please write 5 5 now"], [123], n=1, temperature=0.8)
    tok = engine.tokenizer
    enc = tok(["please write 5 5 now"], return_tensors="pt")
    full = torch.tensor([enc["input_ids"][0].tolist() + ids])
    logits = engine.model(input_ids=full).logits[0, enc["input_ids"].shape[1] - 1 : -1] / 0.8
    want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])
    assert torch.allclose(torch.tensor(lps), want.squeeze(-1), atol=1e-5)


def test_bad_seeds_are_refused_in_one_line(engine: Engine) -> None:
    body = {"prompt": ["please write 1 1 now", "now"], "seed": [1]}
    with pytest.raises(BadRequest, match="must hold 2 integers"):
        engine.parse(body)
    with pytest.raises(BadRequest, match="'seed' must be an integer"):
        engine.parse({"prompt": "now", "seed": -1})
    assert engine.parse({"prompt": ["now", "write"], "seed": [1, 2]})[1].seed == (1, 2)
