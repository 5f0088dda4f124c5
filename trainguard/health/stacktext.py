"""Python stack texts (faulthandler's and py-spy's) read: identical stacks grouped, the main
thread's innermost frame of the user's code found. Pure functions of the text."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["aggregate_stacks", "main_frame"]

_HEX = re.compile(r"0x[0-9a-fA-F]+")
_PYSPY_HEADER = re.compile(r"^(Process \d+:|Python v|# rank )")
_THREAD_ID = re.compile(r"^(Thread) \d+(?= )")


def _normalise(stack: str) -> str:
    lines = []
    for line in stack.splitlines():
        if _PYSPY_HEADER.match(line) or not line.strip():
            continue
        line = _THREAD_ID.sub(r"\1", _HEX.sub("0x?", line))
        lines.append(line.rstrip())
    return "\n".join(lines)


def aggregate_stacks(stacks: dict[int, str]) -> list[dict[str, Any]]:
    """Identical stacks (thread ids and addresses aside) → one entry with the rank list,
    largest group first."""
    groups: dict[str, list[int]] = defaultdict(list)
    for r, s in stacks.items():
        groups[_normalise(s)].append(r)
    return [
        {"ranks": sorted(rs), "stack": text}
        for text, rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    ]


_FH_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_PYSPY_FRAME = re.compile(r"^\s+(?P<func>\S+) \((?P<file>[^:()]+):(?P<line>\d+)\)")


_LIBRARY = re.compile(r"[/\\](torch|trainguard|threading\.py)([/\\]|$)|threading\.py$")


def main_frame(stack: str) -> str | None:
    """Innermost frame of the main thread (faulthandler or py-spy text) outside torch and
    trainguard, as ``func (file:line)``: where the user's code called in."""
    lines = stack.splitlines()
    for i, line in enumerate(lines):
        is_main = ("MainThread" in line) or (
            line.startswith(("Thread 0x", "Current thread 0x")) and i == _last_thread_header(lines)
        )
        if not is_main:
            continue
        for frame in lines[i + 1 :]:
            m = _FH_FRAME.match(frame) or _PYSPY_FRAME.match(frame)
            if m and not _LIBRARY.search(m["file"]):
                return f"{m['func']} ({Path(m['file']).name}:{m['line']})"
            if not frame.strip():
                break
    return None


def _last_thread_header(lines: list[str]) -> int:
    """faulthandler lists the main thread last."""
    idx = [i for i, ln in enumerate(lines) if ln.startswith(("Thread 0x", "Current thread 0x"))]
    return idx[-1] if idx else -1
