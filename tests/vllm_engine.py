"""What the real-vLLM tests share (``make test-engines``): where vLLM is, and the skip.

The tests marked ``engines`` need vLLM's own environment (``make engines`` builds
``.venv-vllm``; ``$TRAINGUARD_VLLM_PYTHON`` names its interpreter). ``make test`` deselects them;
``make test-engines`` sets ``TRAINGUARD_REQUIRE_ENGINES=1``, where a missing vLLM fails instead
of skipping.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.launch_utils import REPO

VLLM_ARGS = ["--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "8",
             "--dtype", "float32", "--kv-cache-memory-bytes", "67108864"]  # fmt: skip
"""vLLM's arguments in these tests: eager (the first generation after start-up takes ~30 s
instead of a 50 s compile on 2 cores), float32 (log-probs comparable with the trainer's), 64 MiB
of KV cache (the tiny Llama needs 1 KiB a token; vLLM's CPU default here is 1 GiB)."""


def vllm_python() -> str | None:
    py = os.environ.get("TRAINGUARD_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    return py if os.access(py, os.X_OK) else None


def require_vllm() -> str:
    """The vLLM interpreter, or a skip (a failure under ``make test-engines``)."""
    py = vllm_python()
    if py is None:
        why = "no vLLM engine venv (make engines builds .venv-vllm; make test-engines runs this)"
        if os.environ.get("TRAINGUARD_REQUIRE_ENGINES") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return py


def http_json(
    port: int, method: str, path: str, body: Any = None, timeout: float = 120.0
) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw


def vllm_children(pid: int) -> list[int]:
    """The PIDs below ``pid`` (vLLM's API server and engine core)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    kids: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        kids.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def model_dir(root: Path) -> Path:
    from trainguard.rl.tiny import save_tiny_llama

    return save_tiny_llama(root / "rl" / "models" / "tiny-llama")
