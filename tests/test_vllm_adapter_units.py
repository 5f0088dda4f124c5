"""The vLLM adapter's checks of a weight version before vLLM sees it, as units (no vLLM: the
real-vLLM tests are tests/test_engine_vllm.py, under ``make test-engines``): a whole file, every
tensor of the model at its shape, the checked copy isolated from the store's file, and the
adapter's one-line refusals when it cannot start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from tests.launch_utils import REPO
from trainguard.core.contracts.engine import ReplicaStatus as S
from trainguard.rl.engines._vllm_complete import Completions
from trainguard.rl.engines._vllm_http import AdapterError
from trainguard.rl.engines._vllm_refit import RefitGate, VerifiedRefit
from trainguard.rl.engines._vllm_server import (
    MODEL_FILE,
    WeightFileError,
    check_safetensors,
    compare_shapes,
    hf_version_dir,
    vllm_python,
)
from trainguard.rl.weights import WeightStore


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


class _ReplicaStandIn:
    """What the adapter's collaborators use of it (the real one: ``VllmAdapter``)."""

    def __init__(self, server: object) -> None:
        self.config = SimpleNamespace(model="tiny-llama", request_timeout_s=5, replica="0")
        self.status = S.SERVING
        self.server = server
        self.model_dir = "/m"
        self.vocab_size = 512
        self.probes = 0
        self.gate: RefitGate | None = None

    def who(self, version: int | None = None) -> str:
        v = self.gate.version if version is None and self.gate else version
        return f"vLLM replica 0 (weight version {v})"

    def generate_probe(self) -> None:
        self.probes += 1

    def check_alive(self, when: str) -> None:
        pass

    def take_fault(self, *kinds: str) -> str | None:
        return None


def test_a_seed_per_prompt_is_one_vllm_request_per_prompt_in_prompt_order() -> None:
    """vLLM takes one ``seed`` a request: the contract's seed list becomes one request per
    prompt (the logic, against a stand-in for vLLM's server; the real one: the conformance
    suite's seeded request under ``make test-engines``)."""
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

    c = Completions(_ReplicaStandIn(VllmStandIn()), RefitGate())  # type: ignore[arg-type]
    out = c.forward({"prompt": ["p", "q", "r"], "n": 2, "seed": [7, 8, 9], "logprobs": 0})
    assert sorted((r["prompt"], r["seed"]) for r in asked) == [("p", 7), ("q", 8), ("r", 9)]
    got = [(c["index"], c["token_ids"]) for c in out["choices"]]
    assert got == [(0, [107]), (1, [107]), (2, [108]), (3, [108]), (4, [109]), (5, [109])]
    with pytest.raises(Exception, match="one integer >= 0 per prompt"):
        c.forward({"prompt": ["p", "q"], "seed": [1]})


def test_a_completion_a_refit_ran_under_is_generated_again_on_the_new_version() -> None:
    """The refit gate: a generation in flight when a refit starts is answered with the new
    version's tokens (generated again), never with the old version's or a mix; one that
    arrives during a refit waits for it."""
    gate = RefitGate()
    gate.version = 1
    calls: list[int | None] = []

    class VllmStandIn:
        def request(self, method: str, path: str, req: dict[str, object], timeout: float) -> object:
            calls.append(gate.version)
            if len(calls) == 1:  # a refit to version 2 runs while this one is generated
                with gate.closed():
                    gate.next_epoch()
                    gate.version = 2
            tok = 10 + (gate.version or 0)
            return 200, {"choices": [{"index": 0, "text": "a", "token_ids": [tok],
                                      "finish_reason": "length", "logprobs": None}]}  # fmt: skip

    replica = _ReplicaStandIn(VllmStandIn())
    replica.gate = gate
    ans = Completions(replica, gate).complete({"prompt": "p"})  # type: ignore[arg-type]
    assert ans["weight_version"] == 2 and ans["choices"][0]["token_ids"] == [12]
    assert calls == [1, 2] and gate.requeued == 1 and gate.inflight == 0

    entered = threading.Event()
    with gate.closed():
        t = threading.Thread(target=lambda: (gate.enter(), entered.set()))
        t.start()
        assert not entered.wait(0.2), "a generation started while a refit held the gate"
    assert entered.wait(10)
    t.join()


class _VllmAdmin:
    """A stand-in for vLLM's admin endpoints: records them, fails ``reload_weights`` when told."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail_reload: set[str] = set()

    def request(self, method: str, path: str, body: object, timeout: float) -> tuple[int, object]:
        if path == "/collective_rpc":
            assert isinstance(body, dict)
            where = body["kwargs"]["weights_path"]
            self.calls.append(f"reload {Path(where).name}")
            if any(where.endswith(v) for v in self.fail_reload):
                return 500, {"error": "size mismatch"}
            return 200, None
        self.calls.append(path if body is None else f"{path} {json.dumps(body)}")
        return 200, None


def _refit(tmp_path: Path) -> tuple[VerifiedRefit, WeightStore, _VllmAdmin, _ReplicaStandIn]:
    store = WeightStore(tmp_path / "rl" / "weights")
    vllm = _VllmAdmin()
    replica = _ReplicaStandIn(vllm)
    replica.status = S.LOADING
    gate = RefitGate()
    replica.gate = gate
    shapes = {"w": (4, 3), "b": (3,)}
    return VerifiedRefit(replica, gate, store, tmp_path / "work", shapes), store, vllm, replica  # type: ignore[arg-type]


def test_a_refit_loads_a_checked_version_by_vllms_own_apis_in_order(tmp_path: Path) -> None:
    r, store, vllm, replica = _refit(tmp_path)
    store.publish(1, {"w": torch.zeros(4, 3), "b": torch.ones(3)})
    assert r.refit(1) >= 0
    assert vllm.calls == ["/pause?mode=keep", "reload v00000001",
                          '/update_weight_version {"new_version": "1"}', "/resume"]  # fmt: skip
    assert (r.gate.version, replica.status, r.refits, replica.probes) == (1, S.SERVING, 1, 1)
    assert r.refit(1) == 0.0 and len(vllm.calls) == 4  # already loaded: nothing asked
    with pytest.raises(AdapterError) as e:
        r.refit(7)
    assert e.value.code == 404 and "weight version 7 is not in" in e.value.message


def test_a_version_that_is_not_the_trainers_bytes_never_reaches_vllm(tmp_path: Path) -> None:
    """The copy is checked against the SHA-256 the trainer wrote (and for every tensor of the
    model at its shape) before vLLM sees it; the same file is refused once, not re-read."""
    r, store, vllm, replica = _refit(tmp_path)
    store.publish(1, {"w": torch.zeros(4, 3), "b": torch.ones(3)})
    r.refit(1)
    vllm.calls.clear()
    src = store.publish(2, {"w": torch.ones(4, 3), "b": torch.ones(3)}).path
    data = bytearray(src.read_bytes())
    data[-1] ^= 0xFF  # a whole file, a flipped byte
    src.write_bytes(bytes(data))
    with pytest.raises(AdapterError) as e:
        r.refit(2)
    assert e.value.code == 422 and "\n" not in e.value.message
    assert "weight version 2 refused: its SHA-256 is" in e.value.message
    assert "republish it whole" in e.value.message
    assert vllm.calls == [] and (r.gate.version, replica.status) == (1, S.SERVING)
    with pytest.raises(AdapterError, match="refused"):
        r.refit(2)
    assert r.refits_failed == 1  # refused once
    store.publish(3, {"w": torch.ones(4, 3)})  # a tensor of the model missing
    with pytest.raises(AdapterError, match="holds 1 of the model's 2 tensors"):
        r.refit(3)
    assert vllm.calls == [] and r.gate.version == 1


def test_a_load_vllm_fails_restores_the_previous_version_or_ends_the_replica(
    tmp_path: Path,
) -> None:
    r, store, vllm, replica = _refit(tmp_path)
    store.publish(1, {"w": torch.zeros(4, 3), "b": torch.ones(3)})
    r.refit(1)
    store.publish(2, {"w": torch.ones(4, 3), "b": torch.ones(3)})
    vllm.fail_reload = {"v00000002"}
    vllm.calls.clear()
    with pytest.raises(AdapterError) as e:
        r.refit(2)
    assert e.value.code == 500 and "serves version 1 again" in e.value.message
    assert "reload v00000001" in vllm.calls and vllm.calls[-1] == "/resume"
    assert (r.gate.version, replica.status, r.fatal) == (1, S.SERVING, None)
    vllm.fail_reload = {"v00000002", "v00000001"}  # the previous one fails too
    with pytest.raises(AdapterError, match="holds no whole version: the replica restarts"):
        r.refit(2)
    assert r.fatal is not None and replica.status == S.LOADING and r.gate.version is None
    with pytest.raises(AdapterError) as again:
        r.refit(1)
    assert again.value.code == 503 and again.value.message == r.fatal


def test_a_quarantined_engine_serves_again_only_once_its_version_is_verified(
    tmp_path: Path,
) -> None:
    r, store, _, replica = _refit(tmp_path)
    store.publish(1, {"w": torch.zeros(4, 3), "b": torch.ones(3)})
    r.refit(1)
    r.quarantine(1, "log-probs differ")
    assert replica.status == S.QUARANTINED and r.quarantines == 1
    store.publish(2, {"w": torch.ones(4, 3), "b": torch.ones(3)})
    r.refit(2)
    assert replica.status == S.QUARANTINED  # a refit alone does not lift it
    assert not r.verified(1) and replica.status == S.QUARANTINED
    assert r.verified(2) and replica.status == S.SERVING


def test_the_tiny_llama_is_built_once_whole_by_processes_that_need_it_at_once(
    tmp_path: Path,
) -> None:
    """A trainer's ranks and its engines build the tiny Llama's directory at the same moment:
    every process returns one whole directory (a partial one, left by a builder killed midway,
    is built again)."""
    from trainguard.rl.tiny import TINY_LLAMA_FILES

    dest = tmp_path / "models" / "tiny-llama"
    dest.mkdir(parents=True)
    (dest / "tokenizer.json").write_text("{}")  # what a builder killed midway left
    code = (
        "import sys; from trainguard.rl.tiny import save_tiny_llama; "
        "print(save_tiny_llama(sys.argv[1]))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(dest)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e.decode()[-2000:] for _, e in outs]
    assert {o.decode().strip() for o, _ in outs} == {str(dest)}
    assert set(TINY_LLAMA_FILES) <= {f.name for f in dest.iterdir()}
    assert all((dest / f).stat().st_size > 2 for f in TINY_LLAMA_FILES)
    assert json.loads((dest / "config.json").read_text())["model_type"] == "llama"
    leftovers = [p.name for p in dest.parent.iterdir() if p.is_dir() and p != dest]
    assert leftovers == []  # no builder's temporary directory
