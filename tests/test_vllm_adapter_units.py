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
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINGUARD_VLLM_PYTHON": sys.executable,
           "TRAINGUARD_AGENT_ROLE_TOKEN": "t" * 64}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "trainguard.rl.engines.vllm", "--port", "0", "--weights-dir",
         str(tmp_path / "rl" / "weights"), "--model", str(tmp_path / "no-model")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert "not a Hugging Face model directory" in last and "no-model" in last


def test_an_adapter_without_the_jobs_token_refuses_to_start(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINGUARD_VLLM_PYTHON": sys.executable}
    env.pop("TRAINGUARD_AGENT_ROLE_TOKEN", None)
    out = subprocess.run(
        [sys.executable, "-m", "trainguard.rl.engines.vllm", "--port", "0", "--weights-dir",
         str(tmp_path / "rl" / "weights")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "no job token: TRAINGUARD_AGENT_ROLE_TOKEN" in out.stderr.strip().splitlines()[-1]


def test_a_vllm_that_never_answers_is_one_line_naming_the_replica_and_the_fix(
    tmp_path: Path,
) -> None:
    """A vLLM that starts and never answers ``/health`` (here a process that only sleeps):
    after ``--start-timeout-s`` the adapter ends it and exits with one line; the role
    supervisor then restarts the replica within its budget."""
    from trainguard.rl.engines.launch import tiny_model_dir

    model = tiny_model_dir(tmp_path)
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexec sleep 300\n")
    fake.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINGUARD_AGENT_ROLE_REPLICA": "3",
           "TRAINGUARD_AGENT_ROLE_TOKEN": "t" * 64}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "trainguard.rl.engines.vllm", "--port", "0", "--weights-dir",
         str(tmp_path / "rl" / "weights"), "--model", str(model), "--vllm-python", str(fake),
         "--start-timeout-s", "2"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("vLLM replica 3: vLLM did not answer /health within 2 s"), last
    assert "(--start-timeout-s)" in last and str(model) in last and "allow it more time" in last
    gone = subprocess.run(["pgrep", "-f", f"{fake} -m vllm"], capture_output=True, text=True)
    assert gone.stdout.strip() == "", "the adapter left its vLLM running"


def test_the_adapters_http_side_checks_the_token_and_signs_its_answers() -> None:
    """Every request signed with the job's token, every answer signed back; anything else
    a 401 with one line (the adapter's server, in-process, over a stand-in adapter)."""
    import threading
    from types import SimpleNamespace

    from trainguard.core.fleetauth import Authenticator
    from trainguard.core.jsonhttp import request
    from trainguard.rl.engines._vllm_http import make_server

    token = "k" * 64

    class Stand:
        auth = Authenticator("rollout", token)
        version = 4
        status = "serving"
        config = SimpleNamespace(model="tiny-llama", fault_injection=False)

        def health(self) -> dict[str, object]:
            return {"status": "serving", "weight_version": 4}

    srv = make_server(Stand(), "127.0.0.1", 0)  # type: ignore[arg-type]
    port = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = request("127.0.0.1", port, "GET", "/health", timeout=10, max_bytes=1 << 16,
                    token=token)  # fmt: skip
        assert r.status == 200 and b'"weight_version": 4' in r.body
        bare = request("127.0.0.1", port, "GET", "/health", timeout=10, max_bytes=1 << 16,
                       verify_answer=False)  # fmt: skip
        assert bare.status == 401 and b"\\n" not in bare.body and b"weight_version" not in bare.body
        other = request("127.0.0.1", port, "GET", "/health", timeout=10, max_bytes=1 << 16,
                        token="x" * 64)  # fmt: skip
        assert other.status == 401 and b"weight_version" not in other.body
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_seed_per_prompt_is_one_vllm_request_per_prompt_in_prompt_order() -> None:
    """vLLM takes one ``seed`` a request: the contract's seed list becomes one request per
    prompt (the logic, against a stand-in for vLLM's server; the real one: the conformance
    suite's seeded request under ``make test-engines``)."""
    from trainguard.rl.engines.vllm import VllmAdapter

    asked: list[dict[str, object]] = []

    class VllmStandIn:
        def request(self, method: str, path: str, req: dict[str, object], timeout: float) -> object:
            asked.append(req)
            seed, n = req["seed"], req.get("n", 1)
            assert isinstance(seed, int) and isinstance(n, int)
            choice = {"text": "a", "finish_reason": "length",
                      "logprobs": {"tokens": ["a"], "token_logprobs": [-0.5]}}  # fmt: skip
            return 200, {"choices": [{**choice, "index": j, "token_ids": [100 + seed]}
                                     for j in range(n)]}  # fmt: skip

    a = VllmAdapter.__new__(VllmAdapter)
    a.config = type("C", (), {"model": "tiny-llama", "request_timeout_s": 5, "replica": "0"})()  # type: ignore[assignment]
    a.server, a.vocab_size, a.version, a.model_dir = VllmStandIn(), 512, 0, "/m"  # type: ignore[assignment]
    out = a._forward({"prompt": ["p", "q", "r"], "n": 2, "seed": [7, 8, 9], "logprobs": 0},
                     checked=True)  # fmt: skip
    assert sorted((r["prompt"], r["seed"]) for r in asked) == [("p", 7), ("q", 8), ("r", 9)]
    got = [(c["index"], c["token_ids"]) for c in out["choices"]]
    assert got == [(0, [107]), (1, [107]), (2, [108]), (3, [108]), (4, [109]), (5, [109])]
    with pytest.raises(Exception, match="one integer >= 0 per prompt"):
        a._forward({"prompt": ["p", "q"], "seed": [1]}, checked=True)
