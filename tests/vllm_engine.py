"""What the real-vLLM tests share (``make test-engines``): where vLLM is, and the skip.

The tests marked ``engines`` need vLLM's own environment (``make engines`` builds
``.venv-vllm``; ``$TRAINGUARD_VLLM_PYTHON`` names its interpreter). ``make test`` deselects them;
``make test-engines`` sets ``TRAINGUARD_REQUIRE_ENGINES=1``, where a missing vLLM fails instead
of skipping.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.launch_utils import REPO
from trainguard.core.jsonhttp import TransportError, request
from trainguard.rl.engines.launch import TINY_VLLM_ARGS

VLLM_ARGS = list(TINY_VLLM_ARGS)
"""vLLM's arguments in these tests: the tiny Llama's (:data:`trainguard.rl.engines.launch.TINY_VLLM_ARGS`)."""

TOKEN = secrets.token_hex(32)
"""The ``rollout`` token of the adapters these tests start (``adapter_env``): every request
signed, every answer's signature checked."""


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
    port: int,
    method: str,
    path: str,
    body: Any = None,
    timeout: float = 120.0,
    token: str | None = TOKEN,
) -> tuple[int, Any]:
    """``(status, parsed JSON, else the raw body)``, signed with ``token`` (the answer's
    signature checked); OSError when there is no usable answer."""
    try:
        r = request("127.0.0.1", port, method, path, body, timeout=timeout, max_bytes=1 << 26,
                    token=token)  # fmt: skip
    except TransportError as e:
        raise OSError(str(e)) from None
    try:
        return r.status, json.loads(r.body)
    except ValueError:
        return r.status, r.body


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
    from trainguard.rl.engines.launch import tiny_model_dir

    return tiny_model_dir(root)
