"""The layout of a run directory (``--tg-run-dir``): every path in it is spelled here.

::

    events.jsonl                          lifecycle events (trainguard.core.events)
    config.json                           the effective config and torchrun's arguments
    metrics/rank_<r>.jsonl                each worker's step and log records
    progress/attempt_<a>/rank_<r>.bin     the progress channel of one attempt
    checkpoints/                          checkpoints, unless [checkpoint] dir says otherwise
    stacks/attempt_<a>/                   stacks of hung workers
    roles/<role>/<i>.json                 state of role replica i (rollout, reward engines)
    roles/<role>/<i>.log                  its output (stdout and stderr, every restart)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.core.config import CONFIG_JSON
from trainguard.core.events import EVENTS_FILE

__all__ = ["RunDir"]


@dataclass(frozen=True, slots=True)
class RunDir:
    """Paths of one run directory (nothing is created or read here)."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def events(self) -> Path:
        return self.root / EVENTS_FILE

    @property
    def config(self) -> Path:
        return self.root / CONFIG_JSON

    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics"

    def metrics(self, rank: int) -> Path:
        """The records of global rank ``rank``."""
        return self.metrics_dir / f"rank_{rank}.jsonl"

    def metrics_files(self) -> list[Path]:
        """Every rank's records file, sorted by name."""
        return sorted(self.metrics_dir.glob("rank_*.jsonl"))

    @staticmethod
    def metrics_rank(path: Path) -> int | None:
        """The rank of a :meth:`metrics` path, None for another name."""
        try:
            return int(path.stem.split("_", 1)[1])
        except (IndexError, ValueError):
            return None

    @property
    def checkpoints(self) -> Path:
        """The default checkpoint root (``[checkpoint] dir`` overrides it)."""
        return self.root / "checkpoints"

    def progress(self, attempt: int) -> Path:
        """The progress channel directory of ``attempt``."""
        return self.root / "progress" / f"attempt_{attempt}"

    def attempts(self) -> list[int]:
        """The attempts that have a progress directory, oldest first."""
        out = []
        for d in self.progress(0).parent.glob("attempt_*"):
            try:
                out.append(int(d.name.split("_", 1)[1]))
            except ValueError:
                continue
        return sorted(out)

    def stacks(self, attempt: int) -> Path:
        """Where the stacks of ``attempt``'s hung workers go."""
        return self.root / "stacks" / f"attempt_{attempt}"

    @property
    def roles(self) -> Path:
        """Where the role supervisor keeps its replicas' state files and logs."""
        return self.root / "roles"

    def role_state(self, role: str, replica: int) -> Path:
        """The state of one replica (JSON: pid, port, url, state, restarts, weight_version,
        timestamps), replaced atomically at each change."""
        return self.roles / role / f"{replica}.json"

    def role_log(self, role: str, replica: int) -> Path:
        """The output of one replica, appended to across its restarts."""
        return self.roles / role / f"{replica}.log"

    def role_states(self) -> dict[str, list[dict[str, Any]]]:
        """Every replica's last state, by role, replica 0 first (unreadable files skipped)."""
        out: dict[str, list[dict[str, Any]]] = {}
        for path in sorted(self.roles.glob("*/*.json")):
            try:
                state = json.loads(path.read_text())
                idx = int(path.stem)
            except (OSError, ValueError):
                continue
            if isinstance(state, dict):
                out.setdefault(path.parent.name, []).append({"replica": idx, **state})
        for states in out.values():
            states.sort(key=lambda s: s["replica"])
        return out
