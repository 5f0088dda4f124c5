"""The vLLM adapter (``python -m trainguard.rl.engines.vllm``) against a real vLLM (``make
test-engines``): one adapter and its vLLM child for the module, the tiny Llama built here,
the weight store real. Completions carry token ids, log-probs and the version that generated
them, per-request seeds are honoured, a refit goes through vLLM's own pause / reload /
version / resume and the answers after it are the new weights' (checked against the trainer's
own log-probs), in-flight requests survive a refit on one version, and every bad refit (a
version not in the store, a truncated file, a load vLLM fails half-way) is one line and leaves
the engine serving a whole version."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.launch_utils import REPO
from tests.vllm_engine import (
    TOKEN,
    VLLM_ARGS,
    http_json,
    model_dir,
    require_vllm,
    vllm_children,
)
from trainguard.rl.engines.launch import adapter_command, adapter_env, teacher_logprobs
from trainguard.rl.weights import WeightStore
from trainguard.testing.ports import free_port

pytestmark = [pytest.mark.engines, pytest.mark.timeout(1800)]  # vLLM's start-up: minutes

PROMPT = "please write 3 4 now"


class Adapter:
    def __init__(self, root: Path, py: str, args: list[str], port: int | None = None) -> None:
        self.root, self.port = root, port or free_port()
        env = adapter_env(root, TOKEN, vllm_python=py)
        env["PYTHONPATH"] = str(REPO)
        self.log = (root / "adapter.log").open("ab")
        vllm_args = args[args.index("--") + 1 :] if "--" in args else []
        own = args[: args.index("--")] if "--" in args else args
        self.proc = subprocess.Popen(
            adapter_command("--port", str(self.port), "--poll-interval-s", "0.3", *own,
                            vllm_args=vllm_args),
            env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=root,
        )  # fmt: skip

    def health(self) -> dict[str, Any] | None:
        try:
            code, h = http_json(self.port, "GET", "/health", timeout=5)
        except OSError:
            return None
        return h if code == 200 else None

    def wait(
        self, status: str = "serving", version: int | None = None, timeout: float = 600
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        seen = []
        while True:
            h = self.health()
            if h is not None and (not seen or seen[-1] != h["status"]):
                seen.append(h["status"])
            if h and h["status"] == status and (version is None or h["weight_version"] == version):
                return {**h, "seen": seen}
            if self.proc.poll() is not None:
                raise AssertionError(f"adapter exited {self.proc.returncode}: {self.tail()}")
            assert time.monotonic() < deadline, f"not {status} after {timeout} s: {h}"
            time.sleep(0.2)

    def tail(self) -> str:
        return (self.root / "adapter.log").read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            kids = vllm_children(self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                for pid in [self.proc.pid, *kids]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.proc.wait()
        self.log.close()


def hf_logprobs(state: dict[str, Any], prompt: str, token_ids: list[int]) -> list[float]:
    """The trainer's log-probs of ``token_ids`` after ``prompt`` under weights ``state``."""
    from trainguard.rl.tiny import TINY_LLAMA, load_model

    model, tok = load_model(TINY_LLAMA)
    model.load_state_dict(state)
    return teacher_logprobs(model, tok, prompt, token_ids)


def perturbed(state: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in state.items()}


@pytest.fixture(scope="module")
def engine(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Adapter, WeightStore, dict[int, Any]]]:
    py = require_vllm()
    root = tmp_path_factory.mktemp("vllm")
    from trainguard.rl.tiny import load_model

    base, _ = load_model(str(model_dir(root)))
    store = WeightStore(root / "rl" / "weights", keep=10)
    states = {0: {k: v.clone() for k, v in base.state_dict().items()}}
    states[1] = perturbed(states[0], 1)
    store.publish(0, states[0])
    a = Adapter(root, py, ["--enable-fault-injection", "--", *VLLM_ARGS])
    try:
        a.wait("serving", 0)
        yield a, store, states
    finally:
        a.close()


def complete(a: Adapter, **body: Any) -> dict[str, Any]:
    code, ans = http_json(a.port, "POST", "/v1/completions", {"prompt": PROMPT, **body})
    assert code == 200, ans
    return ans


def test_completions_carry_token_ids_logprobs_version_and_honour_seeds(engine: Any) -> None:
    a, _, states = engine
    ans = complete(a, prompt=[PROMPT, "please write 7 1 now"], n=2, max_tokens=6,
                   temperature=1.0, logprobs=0, seed=11)  # fmt: skip
    assert ans["weight_version"] == 0 and len(ans["choices"]) == 4
    assert [c["index"] for c in ans["choices"]] == [0, 1, 2, 3]
    for c in ans["choices"]:
        assert c["token_ids"] and len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"])
        assert all(math.isfinite(x) and x <= 0 for x in c["logprobs"]["token_logprobs"])
    again = complete(a, prompt=[PROMPT, "please write 7 1 now"], n=2, max_tokens=6,
                     temperature=1.0, logprobs=0, seed=11)  # fmt: skip
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in ans["choices"]]
    others = [complete(a, max_tokens=6, temperature=1.0, seed=s)["choices"][0]["token_ids"]
              for s in range(12, 16)]  # fmt: skip
    assert len({tuple(t) for t in others}) > 1, "the seed is not passed through"
    # what vLLM generated is what the trainer's model gives (same weights, float32)
    c = complete(a, max_tokens=8, temperature=0.0, logprobs=0)["choices"][0]
    ref = hf_logprobs(states[0], PROMPT, c["token_ids"])
    assert max(abs(x - y) for x, y in zip(ref, c["logprobs"]["token_logprobs"], strict=True)) < 1e-3
    code, err = http_json(a.port, "POST", "/v1/completions", {"prompt": PROMPT, "stream": True})
    assert code == 400 and "stream" in err["error"]["message"]


def test_refit_through_vllms_apis_serves_the_new_weights_and_keeps_inflight_requests(
    engine: Any,
) -> None:
    a, store, states = engine
    store.publish(1, states[1])  # the watcher may refit first; the push is then a no-op
    code, ans = http_json(a.port, "POST", "/v1/weights/update", {"version": 1})
    assert code == 200 and ans["version"] == 1, ans
    a.wait("serving", 1)
    c = complete(a, max_tokens=8, temperature=0.0, logprobs=0)
    assert c["weight_version"] == 1
    ref = hf_logprobs(states[1], PROMPT, c["choices"][0]["token_ids"])
    got = c["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(x - y) for x, y in zip(ref, got, strict=True)) < 1e-3

    # requests in flight while versions 2 and 3 are loaded: each answered, each by one version
    states[2], states[3] = perturbed(states[1], 2), perturbed(states[1], 3)
    store.publish(2, states[2])
    before = a.health()
    assert before is not None
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(complete, a, max_tokens=48, temperature=0.0, logprobs=0)
                for _ in range(12)]  # fmt: skip
        time.sleep(0.3)
        store.publish(3, states[3])
        answers = [f.result() for f in futs]
    a.wait("serving", 3)
    for ans in answers:
        v = ans["weight_version"]
        assert v in (1, 2, 3)
        ch = ans["choices"][0]
        ref = hf_logprobs(states[v], PROMPT, ch["token_ids"])
        diff = max(abs(x - y) for x, y in zip(ref, ch["logprobs"]["token_logprobs"], strict=True))
        assert diff < 1e-3, f"an answer labelled version {v} is not version {v}'s ({diff})"
    after = a.health()
    assert after is not None and after["refits"] > before["refits"]


def test_bad_refits_are_one_line_and_leave_a_whole_version_serving(engine: Any) -> None:
    a, store, states = engine
    h = a.wait("serving")
    v = h["weight_version"]
    first = complete(a, max_tokens=8, temperature=0.0, logprobs=0)["choices"][0]

    code, err = http_json(a.port, "POST", "/v1/weights/update", {"version": 99})
    msg = err["error"]["message"]
    assert code == 404 and "\n" not in msg
    assert "replica 0" in msg and "version 99" in msg and "publish it" in msg

    # a truncated file: refused before vLLM sees it
    bad = store.root / "v00000077.safetensors"
    data = store.path_of(v).read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    code, err = http_json(a.port, "POST", "/v1/weights/update", {"version": 77})
    msg = err["error"]["message"]
    assert code == 422 and "\n" not in msg and "truncated" in msg and "version 77" in msg
    bad.unlink()

    # half of the tensors (vLLM would load them over the old ones and only log it): refused
    from safetensors.torch import save_file

    states[50] = perturbed(states[0], 50)
    names = sorted(states[50])
    half = {k: states[50][k].contiguous() for k in names[: len(names) // 2]}
    save_file(half, str(store.path_of(50)))
    code, err = http_json(a.port, "POST", "/v1/weights/update", {"version": 50})
    msg = err["error"]["message"]
    assert code == 422 and "\n" not in msg and "version 50" in msg and "missing" in msg, msg
    h = a.wait("serving", v, timeout=5)
    assert h["refits_failed"] >= 2 and h["last_error"] == msg
    again = complete(a, max_tokens=8, temperature=0.0, logprobs=0)
    assert again["weight_version"] == v
    assert again["choices"][0]["token_ids"] == first["token_ids"]
    assert again["choices"][0]["logprobs"] == first["logprobs"]
    # and the same version, published whole (the pointer on it: the store watcher keeps the
    # engine on the pointer's version), loads
    store.publish(50, states[50])
    code, ans = http_json(a.port, "POST", "/v1/weights/update", {"version": 50})
    assert code == 200
    a.wait("serving", 50, timeout=30)
    got = complete(a, max_tokens=8, temperature=0.0, logprobs=0)
    assert got["weight_version"] == 50
    c = got["choices"][0]
    ref = hf_logprobs(states[50], PROMPT, c["token_ids"])
    assert max(abs(x - y) for x, y in zip(ref, c["logprobs"]["token_logprobs"], strict=True)) < 1e-3


def test_malformed_and_failed_answers_are_injected_at_the_contract(engine: Any) -> None:
    a, _, _ = engine
    http_json(a.port, "POST", "/v1/faults", {"kind": "malformed", "count": 1})
    code, raw = http_json(a.port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert code == 200 and isinstance(raw, bytes)  # a torn body
    http_json(a.port, "POST", "/v1/faults", {"kind": "http_500", "count": 1})
    code, err = http_json(a.port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert code == 500
    assert complete(a, max_tokens=2)["choices"]


def test_zz_a_load_vllm_fails_midway_restarts_the_replica_with_one_line(engine: Any) -> None:
    """A tensor of a wrong shape past the adapter's check: vLLM loads what comes before it,
    answers 500 and its engine dies. The adapter answers the refit with one line and exits 3
    (the role supervisor restarts or replaces the replica); it never serves in between.
    Last in the module: it ends the module's engine."""
    a, store, states = engine
    states[60] = perturbed(states[0], 60)
    store.publish(60, states[60])
    http_json(a.port, "POST", "/v1/faults", {"kind": "refit_500", "count": 1})
    code, err = http_json(a.port, "POST", "/v1/weights/update", {"version": 60})
    msg = err["error"]["message"]
    assert code == 500 and "\n" not in msg and "version 60" in msg and "restarts" in msg, msg
    h = a.health()
    assert h is None or h["status"] != "serving"
    assert a.proc.wait(120) == 3
    assert any(msg in line for line in a.tail().strip().splitlines()[-5:])


def test_a_model_directory_vllm_cannot_load_is_one_line(tmp_path: Path) -> None:
    """Head size 16: vLLM's CPU attention refuses it (after its start-up, or on the first
    request, which the adapter's readiness generation makes)."""
    py = require_vllm()
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainguard.rl.tiny import tiny_llama_tokenizer

    d = tmp_path / "bad-model"
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(d)
    tiny_llama_tokenizer().save_pretrained(d)
    a = Adapter(tmp_path, py, ["--model", str(d), "--", *VLLM_ARGS])
    try:
        rc = a.proc.wait(600)
    finally:
        a.close()
    assert rc == 2
    lines = a.tail().strip().splitlines()[-5:]
    assert any("vLLM replica 0" in ln and str(d) in ln for ln in lines), lines

    missing = Adapter(tmp_path, py, ["--model", str(tmp_path / "nowhere")])
    try:
        assert missing.proc.wait(120) == 2
    finally:
        missing.close()
    last = missing.tail().strip().splitlines()[-1]
    assert "not a Hugging Face model directory" in last and "nowhere" in last
