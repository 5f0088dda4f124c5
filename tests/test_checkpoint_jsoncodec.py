"""The JSON codec for checkpoint metadata (skeletons, RNG states): round trips, no pickle."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from trainguard.checkpoint import jsoncodec
from trainguard.checkpoint.staging import flatten, unflatten
from trainguard.checkpoint.state import rng_state, set_rng_state


def test_round_trip_values() -> None:
    obj = {
        "a": [1, 2.5, None, True, "x", b"\x00\xff"],
        "t": (1, (2, 3)),
        "nan": float("nan"),
        "inf": -math.inf,
        "keys": {1: "int key", (2, 3): "tuple key", "$x": "dollar"},
        "np": np.arange(6, dtype=np.int64).reshape(2, 3),
        "scalar": np.float32(1.5),
        "tensor": torch.arange(5, dtype=torch.uint8),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
    }
    back = jsoncodec.loads(jsoncodec.dumps(obj))
    assert back["a"] == obj["a"] and back["t"] == obj["t"]
    assert math.isnan(back["nan"]) and back["inf"] == -math.inf
    assert back["keys"] == obj["keys"]
    assert np.array_equal(back["np"], obj["np"]) and back["np"].dtype == np.int64
    assert back["scalar"] == 1.5
    assert torch.equal(back["tensor"], obj["tensor"])
    assert back["dtype"] is torch.bfloat16 and back["size"] == torch.Size([2, 3])


def test_skeleton_with_tensor_refs_round_trips() -> None:
    state = {"model": {"w": torch.ones(2)}, "step": 7, "opt": [{"lr": 0.1, "betas": (0.9, 0.99)}]}
    skeleton, tensors = flatten(state)
    back = unflatten(jsoncodec.loads(jsoncodec.dumps(skeleton)), tensors)
    assert back["step"] == 7 and back["opt"][0]["betas"] == (0.9, 0.99)
    assert back["model"]["w"] is tensors[0]


def test_rng_state_is_json_and_restores() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    blob = rng_state()
    assert blob.startswith(b"{")  # JSON, not a pickle
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(blob)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def test_unsupported_object_names_path_and_fix() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"extra\.thing.*Opaque.*state_dict"):
        jsoncodec.dumps({"extra": {"thing": Opaque()}})


def test_loads_never_unpickles() -> None:
    import pickle

    with pytest.raises(ValueError):
        jsoncodec.loads(pickle.dumps({"a": 1}))
