"""Another local process at a fleet server's port (``tests/workers/fleet_intruder.py``), and
what a refusal must look like."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

INTRUDER = Path(__file__).parent / "workers" / "fleet_intruder.py"


def intrude(port: int, version: int, file: Path, token: str | None = None) -> list[dict[str, Any]]:
    """What another local process (``tests/workers/fleet_intruder.py``) gets from ``port``."""
    args = [
        sys.executable,
        str(INTRUDER),
        str(port),
        "--version",
        str(version),
        "--file",
        str(file),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD")}
    out = subprocess.run(
        [*args, *(["--token", token] if token else [])],
        capture_output=True, text=True, timeout=120, env=env, check=True,
    )  # fmt: skip
    answers: list[dict[str, Any]] = json.loads(out.stdout)
    return answers


def refusal(answers: list[dict[str, Any]]) -> str:
    """The one line every answer carried (each a 401, all the same, naming nothing but the
    missing token)."""
    assert [a["status"] for a in answers] == [401] * len(answers), answers
    bodies = {a["body"] for a in answers}
    assert len(bodies) == 1, bodies  # whatever was asked: nothing learned, no oracle
    body = json.loads(bodies.pop())
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}
    message: str = body["error"]["message"]
    assert "\n" not in message and not any(ch.isdigit() for ch in message), message
    return message
