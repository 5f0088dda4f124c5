"""Supervision of this rank's persister process (``persist_mode = "process"``).

The persisters of all ranks form one gloo group, so one dead persister (kill -9, OOM) leaves
the others stuck in a collective with it: when any rank's persister died, every rank kills its
own and starts a new generation (a fresh store prefix), after the manager made sure nothing of
the old generation is still writing. A persister that cannot start at all on some rank makes
every rank persist in a thread instead (:mod:`trainguard.checkpoint.persist_proc`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.checkpoint.consensus import Consensus
from trainguard.core.config.checkpoint import CheckpointConfig
from trainguard.core.contracts import envvars

if TYPE_CHECKING:
    from trainguard.checkpoint.persist_proc import PersisterProcess

__all__ = ["PersisterSupervisor"]

logger = logging.getLogger(__name__)


class PersisterSupervisor:
    """This rank's persister process ``proc`` (None: persisting in a thread) and its
    replacement when any rank's persister died. ``instance`` tells the persister groups of
    several managers in one process apart; ``cleanup_dir`` is removed by the persister if
    its worker dies (process mode's private staging directory)."""

    def __init__(
        self,
        *,
        root: str,
        config: CheckpointConfig,
        rank: int,
        world_size: int,
        instance: int,
        cleanup_dir: Path | None,
        consensus: Consensus,
        emit: Callable[..., object],
    ) -> None:
        self.root = root
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.instance = instance
        self.cleanup_dir = cleanup_dir
        self.consensus = consensus
        self._emit = emit
        self.proc: PersisterProcess | None = None
        self.generation = 0
        self.started = False
        """The first persister was started (at the first save to disk)."""
        self._all_ready = False

    def start(self) -> None:
        """Start this rank's persister process of generation :attr:`generation`."""
        from trainguard.checkpoint.persist_proc import PersisterProcess

        self.started = True
        attempt = os.environ.get(envvars.ATTEMPT) or os.environ.get("TORCHELASTIC_RESTART_COUNT")
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        init = {
            "root": self.root,
            "config": dataclasses.asdict(self.config),
            "rank": self.rank,
            "world_size": self.world_size,
            "master_addr": os.environ.get("MASTER_ADDR"),
            "master_port": os.environ.get("MASTER_PORT"),
            "prefix": f"trainguard/ckpt-persist/{run_id}/{attempt}/{self.instance}/"
            f"{self.generation}/",
            "timeout_s": self.config.collective_timeout_s,
            # the persister removes the private staging directory if its worker dies
            "cleanup_dir": str(self.cleanup_dir) if self.cleanup_dir else None,
        }
        self.proc = PersisterProcess(init, timeout_s=self.config.persist_timeout_s)
        self._emit_rank0("checkpoint_persister_started", pid=self.proc.pid, gen=self.generation)

    def broken(self) -> bool:
        """This rank's persister died (local; :meth:`check` is the collective reaction)."""
        return self.proc is not None and self.proc.check() is not None

    def check(self, settle: Callable[[], None]) -> bool:
        """Collective. If any rank's persister died, every rank kills its own (their saves in
        flight fail), calls ``settle`` (the manager waits until nothing of the old generation
        is writing and removes what it left uncommitted), and starts a new generation; if one
        could not start at all, every rank persists in a thread from now on. Returns whether
        every rank's persister is ready (False also without one)."""
        proc = self.proc
        if proc is None:
            return False
        broken, failed, waiting = self.consensus.agree(
            proc.check() is not None, proc.start_failed, not proc.poll_ready()
        )
        if not broken:
            self._all_ready = not waiting
            return self._all_ready
        self._all_ready = False
        reason = proc.broken
        proc.kill()
        settle()
        if failed:
            logger.warning("persister process unavailable (%s); persisting in a thread", reason)
            self.proc = None
            return False
        logger.warning("rank %s: replacing the persister processes (%s)", self.rank, reason)
        self._emit_rank0(
            "checkpoint_persister_replaced", reason=reason or "another rank's persister died"
        )
        self.generation += 1
        self.start()
        return False

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()

    def _emit_rank0(self, kind: str, **fields: object) -> None:
        logger.info("%s %s", kind, fields)
        if self.rank == 0:
            self._emit(kind, **fields)
