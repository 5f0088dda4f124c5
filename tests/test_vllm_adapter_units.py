"""The vLLM adapter's checks of a weight version before vLLM sees it, as units (no vLLM: the
real-vLLM tests are tests/test_engine_vllm.py, under ``make test-engines``): a whole file, every
tensor of the model at its shape, the checked copy isolated from the store's file, and the
adapter's one-line refusals when it cannot start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.launch_utils import REPO
from trainguard.rl.engines._vllm_server import (
    MODEL_FILE,
    WeightFileError,
    check_safetensors,
    compare_shapes,
    hf_version_dir,
    vllm_python,
)


def _file(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, str(path))
    return path


def test_a_whole_file_passes_and_a_truncated_or_foreign_one_is_named(tmp_path: Path) -> None:
    f = _file(tmp_path / "v.safetensors", {"a": torch.zeros(4, 3), "b": torch.ones(2)})
    assert check_safetensors(f) == {"a": (4, 3), "b": (2,)}
    data = f.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 9, 3):
        f.write_bytes(data[:cut])
        with pytest.raises(WeightFileError) as e:
            check_safetensors(f)
        assert str(f) in str(e.value) and "\n" not in str(e.value)
    f.write_bytes(data + b"x")  # a longer file is torn too
    with pytest.raises(WeightFileError, match="truncated or torn"):
        check_safetensors(f)
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(WeightFileError, match="not JSON"):
        check_safetensors(f)


def test_a_version_must_hold_every_tensor_of_the_model_at_its_shape() -> None:
    want = {"w": (4, 4), "b": (4,), "c": (2,)}
    assert compare_shapes(dict(want), want) is None
    assert compare_shapes({**want, "extra": (1,)}, want) is None  # e.g. a tied head kept
    missing = compare_shapes({"w": (4, 4)}, want)
    assert missing is not None and "1 of the model's 3" in missing and "b, c" in missing
    wrong = compare_shapes({**want, "b": (7,)}, want)
    assert wrong is not None and "tensor b has shape [7]" in wrong
    assert compare_shapes({}, {}) is None  # a model directory without safetensors


def test_the_copy_vllm_loads_is_not_the_stores_file(tmp_path: Path) -> None:
    src = _file(tmp_path / "v1.safetensors", {"a": torch.arange(6.0)})
    d = hf_version_dir(tmp_path / "work", 1, src)
    copy = d / MODEL_FILE
    assert copy.read_bytes() == src.read_bytes()
    assert os.stat(copy).st_ino != os.stat(src).st_ino
    src.write_bytes(src.read_bytes()[:10])  # damaged in place after the copy
    assert check_safetensors(copy) == {"a": (6,)}
    assert hf_version_dir(tmp_path / "work", 1, _file(src, {"a": torch.ones(6)})) == d  # rebuilt


def test_no_vllm_and_no_model_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(ValueError, match="make engines"):
        vllm_python()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINGUARD_VLLM_PYTHON": sys.executable}
    out = subprocess.run(
        [sys.executable, "-m", "trainguard.rl.engines.vllm", "--port", "0", "--weights-dir",
         str(tmp_path / "rl" / "weights"), "--model", str(tmp_path / "no-model")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert "not a Hugging Face model directory" in last and "no-model" in last
