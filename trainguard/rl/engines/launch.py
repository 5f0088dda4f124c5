"""Starting the vLLM adapter outside a job and talking to it: the command, its environment, a
signed request, and the trainer's own log-probs to check an answer against. What the refit
drill (``bench/vllm_refits.py``), the SGLang check and the real-vLLM tests share, so that
they start their engines the same way.

    cmd = adapter_command("--enable-fault-injection")          # the tiny Llama's vLLM flags
    env = adapter_env(run_dir, token, port=8101)
    subprocess.Popen(cmd, env=env)
    status, health = call(8101, "GET", "/health", token=token)
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from trainguard.core.contracts import envvars
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.jsonhttp import TransportError, request

if TYPE_CHECKING:
    import torch

__all__ = [
    "TINY_VLLM_ARGS",
    "adapter_command",
    "adapter_env",
    "call",
    "teacher_logprobs",
    "tiny_model_dir",
]

TINY_VLLM_ARGS: tuple[str, ...] = (
    "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "8",
    "--dtype", "float32", "--kv-cache-memory-bytes", "67108864",
)  # fmt: skip
"""vLLM's arguments for the tiny Llama on a CPU: eager (the first generation after start-up
takes ~30 s instead of a 50 s compile on 2 cores), float32 (log-probs comparable with the
trainer's), 64 MiB of KV cache (the tiny Llama needs 1 KiB a token; vLLM's CPU default is
1 GiB)."""


def adapter_command(
    *adapter_args: str, vllm_args: Sequence[str] = TINY_VLLM_ARGS, python: str = sys.executable
) -> list[str]:
    """``python -m trainguard.rl.engines.vllm ADAPTER_ARGS -- VLLM_ARGS``."""
    return [python, "-m", "trainguard.rl.engines.vllm", *adapter_args, "--", *vllm_args]


def adapter_env(
    run_dir: str | os.PathLike[str],
    token: str,
    *,
    port: int | None = None,
    replica: int = 0,
    standby: str | os.PathLike[str] | None = None,
    vllm_python: str | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment the role supervisor would give the adapter: the run directory (its
    weight store is ``RUN_DIR/rl/weights``), the job's ``rollout`` token, the replica, its
    port and, for a warm standby, the promotion file it waits for. vLLM's threads are not
    pinned (several engines share a few cores) and the adapter runs one torch thread."""
    env = dict(os.environ if base is None else base)
    for name in (envvars.ROLE_STANDBY, envvars.ROLE_PORT):
        env.pop(name, None)
    env.update({envvars.RUN_DIR: str(run_dir), envvars.ROLE_TOKEN: token,
                envvars.ROLE_REPLICA: str(replica), "OMP_NUM_THREADS": "1"})  # fmt: skip
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if port is not None:
        env[envvars.ROLE_PORT] = str(port)
    if standby is not None:
        env[envvars.ROLE_STANDBY] = str(standby)
    if vllm_python is not None:
        env[envvars.VLLM_PYTHON] = vllm_python
    return env


def call(
    port: int,
    method: str,
    path: str,
    body: object = None,
    *,
    token: str | None = None,
    timeout: float = 120.0,
    max_bytes: int = 1 << 26,
) -> tuple[int, object]:
    """One JSON request to ``127.0.0.1:port``, signed with ``token`` (and the answer's
    signature checked) when given: ``(status, parsed JSON, else the text)``. ``OSError``
    naming why when there is no usable answer (refused, timeout, not signed back)."""
    try:
        r = request("127.0.0.1", port, method, path, body, timeout=timeout,
                    max_bytes=max_bytes, token=token)  # fmt: skip
    except TransportError as e:
        raise OSError(f"{method} {path} on port {port}: {e}") from None
    try:
        return r.status, json.loads(r.body) if r.body else None
    except ValueError:
        return r.status, r.body.decode(errors="replace")[:300]


class _Output(Protocol):
    logits: torch.Tensor


class _CausalLM(Protocol):
    def __call__(self, *, input_ids: torch.Tensor) -> _Output: ...


class _Tokenizer(Protocol):
    def __call__(self, text: str) -> Mapping[str, list[int]]: ...


def teacher_logprobs(
    model: _CausalLM, tokenizer: _Tokenizer, prompt: str, token_ids: list[int]
) -> list[float]:
    """The trainer's log-prob of each of ``token_ids`` after ``prompt`` (teacher-forced, in
    float32): what an engine's ``logprobs.token_logprobs`` for them must equal."""
    import torch

    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        x = torch.tensor([ids + token_ids])
        logits = model(input_ids=x).logits[0, len(ids) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids)[:, None])
    return [float(v) for v in lp.squeeze(-1)]


def tiny_model_dir(root: str | os.PathLike[str]) -> Path:
    """The tiny Llama written as ``root/rl/models/tiny-llama`` (what a job's adapter builds)."""
    from trainguard.rl.tiny import TINY_LLAMA, save_tiny_llama

    return save_tiny_llama(RunDir(root).models / TINY_LLAMA)
