"""Tailing a growing JSONL file (worker metrics, events) without re-reading it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

__all__ = ["JsonlTail"]

logger = logging.getLogger(__name__)


class JsonlTail:
    """Returns the complete lines appended to ``path`` since the last ``read()``, decoded.

    A torn last line (a writer mid-append) is kept until its newline arrives; malformed lines
    are skipped; a missing file reads as empty.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return []
        self.offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    logger.debug("skipping a malformed line in %s", self.path)
        return out
