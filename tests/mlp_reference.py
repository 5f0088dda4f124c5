"""The weights a fault-free run of examples/train_mlp.py ends with, computed in this process.

examples/train_mlp.py is data-parallel SGD with Adam over ``world`` ranks: each rank takes the
gradient of its own batch (a function of step and rank), DistributedDataParallel averages them
(each rank's gradient divided by the world size, then summed: exact in float, and a sum of two
is the same in either order) and every rank takes the same Adam step. Doing that here, one rank
after the other with one intra-op thread (torchrun gives each of several workers one), gives the
same bits as the launched job, without starting one (an agent and two workers: ~10 s of CPU).
``test_run_compat.test_train_mlp_bitwise_identical`` checks it against real runs under torchrun
and trainguard; the fault tests compare their jobs' final weights with it.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_mlp.py"


@cache
def _example() -> Any:
    spec = importlib.util.spec_from_file_location("_train_mlp_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@cache
def _reference(
    steps: int, world: int, dim: int, hidden: int, batch: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    make_batch = _example().make_batch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)  # as the example, before it builds the model
        model = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        params = list(model.parameters())
        opt = torch.optim.Adam(params, lr=1e-2)
        for step in range(steps):
            grads = []
            for rank in range(world):
                x, y = make_batch(step, rank, batch, dim)
                model.zero_grad(set_to_none=True)
                nn.functional.mse_loss(model(x), y).backward()
                grads.append([p.grad.detach().clone() for p in params])  # type: ignore[union-attr]
            for i, p in enumerate(params):
                g = grads[0][i] / world
                for r in range(1, world):
                    g = g + grads[r][i] / world
                p.grad = g
            opt.step()
    finally:
        torch.set_num_threads(threads)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return weights, opt.state_dict()


def train_mlp_reference(
    steps: int, *, world: int = 2, dim: int = 32, hidden: int = 64, batch: int = 16
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(final parameters as ``--out`` saves them, Adam's state as ``--out-optim`` saves it) of
    ``train_mlp.py --steps steps`` on ``world`` ranks with the example's defaults. Cached:
    callers must not modify what they get."""
    return _reference(steps, world, dim, hidden, batch)


def assert_same_as_reference(
    params: Path | dict[str, torch.Tensor], steps: int, *, optim: Path | None = None
) -> None:
    """The parameters (a ``--out`` file or its loaded dict), and Adam's state where given (an
    ``--out-optim`` file), are bitwise those of a fault-free run of ``steps`` steps."""
    want, want_optim = train_mlp_reference(steps)
    got = torch.load(params, weights_only=True) if isinstance(params, Path) else params
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs from a fault-free run's"
    if optim is not None:
        got_optim = torch.load(optim, weights_only=True)
        assert got_optim["param_groups"] == want_optim["param_groups"]
        assert got_optim["state"].keys() == want_optim["state"].keys()
        for i, st in want_optim["state"].items():
            for k in st:
                assert torch.equal(got_optim["state"][i][k], st[k]), (i, k)
