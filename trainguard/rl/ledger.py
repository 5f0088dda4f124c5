"""Lossless prompt accounting: which prompts were handed out, which were trained on.

:class:`PromptLedger` is the prompt stream of an RL run as checkpoint state (it has
``state_dict``/``load_state_dict``: put it in the ``tg.checkpoint`` state next to the model).
Prompts are numbered by a global position ``g``: epoch ``g // N``, place ``g % N`` in that
epoch's permutation (seeded by ``seed`` and the epoch, so every rank and every restart sees
the same order). The ledger holds

- ``next``: the first position not handed out yet;
- ``pending``: positions handed out but not trained on yet, in order (in-flight rollouts);
- ``buffer``: the scored rollouts of pending positions (async mode): restored with the
  checkpoint, so a resumed trainer does not regenerate what was already scored and saved.

``take(k)`` hands out the next ``k`` positions: first the pending positions of a restored
ledger that have no buffered rollout (their generations were lost with the crash), then new
ones. ``commit(positions)`` marks them trained. A checkpoint taken after ``commit`` therefore
never loses a prompt (pending ones are handed out again) and never repeats one (committed
ones are behind ``next`` and out of ``pending``).

:class:`ConsumedLog` is the audit trail: the trainer (rank 0) appends each committed step's
positions to a JSONL file; :func:`audit` replays it (a step re-run after a restore replaces
the earlier record of that step) and counts skipped and duplicated prompts per epoch.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.core.atomicfile import open_append

__all__ = ["Audit", "ConsumedLog", "PromptLedger", "audit"]


class PromptLedger:
    def __init__(self, num_prompts: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if num_prompts < 1:
            raise ValueError(f"PromptLedger(num_prompts={num_prompts}): give at least one prompt")
        self.num_prompts = num_prompts
        self.seed = seed
        self.shuffle = shuffle
        self.next = 0
        self.pending: list[int] = []
        self.buffer: dict[int, Any] = {}
        self._reissue: list[int] = []
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            ids = list(range(self.num_prompts))
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(ids)
            self._orders = {epoch: ids}  # one epoch at a time is enough
        return self._orders[epoch]

    def prompt_id(self, position: int) -> int:
        """The data-set index of the prompt at global position ``position``."""
        return self.order(position // self.num_prompts)[position % self.num_prompts]

    @property
    def trained(self) -> int:
        """Positions trained on so far (handed out and committed)."""
        return self.next - len(self.pending)

    def take(self, k: int) -> list[int]:
        """Hand out ``k`` positions (pending without a rollout first, then new ones)."""
        out = self._reissue[:k]
        self._reissue = self._reissue[k:]
        while len(out) < k:
            out.append(self.next)
            self.pending.append(self.next)
            self.next += 1
        return out

    def reissued(self) -> list[int]:
        """Restored pending positions that still wait to be handed out again."""
        return list(self._reissue)

    def put(self, position: int, rollout: Any) -> None:
        """Keep the scored rollout of a pending position (plain JSON-able values)."""
        if position not in self.pending:
            raise ValueError(f"position {position} is not pending")
        self.buffer[position] = rollout

    def commit(self, positions: Iterable[int]) -> None:
        """``positions`` were trained on: they leave ``pending`` and the buffer."""
        done = set(positions)
        unknown = done.difference(self.pending)
        if unknown:
            raise ValueError(
                f"commit of positions never handed out or already trained: {sorted(unknown)}"
            )
        self.pending = [p for p in self.pending if p not in done]
        self._reissue = [p for p in self._reissue if p not in done]
        for p in done:
            self.buffer.pop(p, None)

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "next": self.next,
            "pending": list(self.pending),
            "buffer": {str(k): v for k, v in self.buffer.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_prompts"]) != self.num_prompts or int(state["seed"]) != self.seed:
            raise ValueError(
                f"the checkpoint's prompt ledger is for {state['num_prompts']} prompts with seed "
                f"{state['seed']}, this run has {self.num_prompts} with seed {self.seed}: resume "
                "with the same data set and seed"
            )
        self.shuffle = bool(state.get("shuffle", True))
        self.next = int(state["next"])
        self.pending = [int(p) for p in state["pending"]]
        self.buffer = {int(k): v for k, v in dict(state.get("buffer") or {}).items()}
        self._reissue = [p for p in self.pending if p not in self.buffer]


class ConsumedLog:
    """Append-only record of the positions each committed step trained on."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def append(
        self, step: int, positions: list[int], prompt_ids: list[int], **extra: object
    ) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"step": step, "positions": positions, "ids": prompt_ids, **extra})
        fd = open_append(self.path)  # never through a symlink
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    def effective(self) -> dict[int, dict[str, Any]]:
        """Step → its record as the run finally kept it (the last one written for it)."""
        out: dict[int, dict[str, Any]] = {}
        if not self.path.exists():
            return out
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # a line torn by a kill -9
                continue
            out[int(rec["step"])] = rec
        return out


@dataclass(frozen=True, slots=True)
class Audit:
    steps: int
    trained: int
    skipped: int
    """Positions below the last one trained that were never trained on."""
    duplicated: int
    """Prompt trainings beyond the first in one epoch."""
    sequence: list[int]
    """Prompt ids in the order the kept steps trained on them."""


def audit(log: ConsumedLog, num_prompts: int) -> Audit:
    """Check exactly-once accounting of the kept steps 0..S-1 of a finished run."""
    recs = log.effective()
    steps = sorted(recs)
    if steps and steps != list(range(steps[-1] + 1)):
        missing = sorted(set(range(steps[-1] + 1)).difference(steps))
        raise ValueError(f"{log.path}: no record for steps {missing[:10]}")
    positions = [p for s in steps for p in recs[s]["positions"]]
    sequence = [i for s in steps for i in recs[s]["ids"]]
    seen: dict[int, set[int]] = {}
    duplicated = 0
    for p, pid in zip(positions, sequence, strict=False):
        ep = seen.setdefault(p // num_prompts, set())
        if pid in ep:
            duplicated += 1
        ep.add(pid)
    top = max(positions, default=-1)
    skipped = len(set(range(top + 1)).difference(positions))  # holes in the stream
    return Audit(len(steps), len(positions), skipped, duplicated, sequence)
