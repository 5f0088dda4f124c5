"""Writing one staged checkpoint and committing it: the part of a save that runs in the
background, in the worker's persist thread (``persist_mode = "thread"``) or in a persister
process per rank (``"process"``, :mod:`trainguard.checkpoint.persist_proc`).

``Writer.write_and_commit`` is collective over its gloo group: every rank writes its DCP shard
through the checksumming writer (fsync), the ranks gather each other's outcome and file
records, rank 0 renames the JSON manifest into place when every rank succeeded (else removes
the step directory; older checkpoints are never touched) and broadcasts the outcome. Retention
(``retention``, rank 0) runs after the outcome is out, so deleting old checkpoints is never
part of the time to a durable commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.faults import Faults
from trainguard.checkpoint.storage import (
    ChecksummingFileSystem,
    ChecksummingWriter,
    Storage,
    fsync_dir,
)
from trainguard.core.config.checkpoint import CheckpointConfig, writer_threads
from trainguard.core.failures import peer_failure

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Writer"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Writer:
    root: str
    storage: Storage
    config: CheckpointConfig
    rank: int
    world_size: int
    pg: ProcessGroup | None = None
    """The gloo group of the persist collectives (None: one process, no collectives)."""
    faults: Faults
    fs_factory: Callable[[], ChecksummingFileSystem] | None = None

    def step_path(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/{mf.step_dir_name(step)}"

    def write_and_commit(
        self, step: int, staged: Any, *, marks: dict[str, str] | None = None
    ) -> tuple[bool, str | None]:
        """Write ``staged`` (a state dict of host tensors) as step ``step``; (committed, error).
        ``marks``: the manifest's ``extra`` (what is known of the state beyond its files)."""
        import torch.distributed.checkpoint as dcp

        path = self.step_path(step)
        fs = self._new_filesystem(step)
        error: str | None = None
        records: dict[str, tuple[int, int]] = {}
        try:
            self.faults.point("persist_start", step, self.rank)
            if "://" in self.root:
                from trainguard.core._torch import fsspec_writer

                writer: Any = fsspec_writer(path, sync_files=self.config.sync_files)
            else:
                Path(path).mkdir(parents=True, exist_ok=True)
                writer = ChecksummingWriter(
                    path,
                    fs=fs,
                    sync_files=self.config.sync_files,
                    thread_count=writer_threads(self.config),
                )
            dcp.save(staged, storage_writer=writer, process_group=self.pg, no_dist=self.pg is None)
            if "://" not in self.root and self.config.sync_files:
                fsync_dir(path)
            records = {Path(p).name: v for p, v in fs.records.items()}
            self.faults.point("written", step, self.rank)
        except (Exception, CheckpointException) as e:
            error = f"{type(e).__name__}: {e}"
            peer = peer_failure(e)
            if peer:  # a consequence of another rank's failure: one line
                error = f"a peer rank failed ({peer})"
                logger.warning(
                    "rank %s: checkpoint step %s not committed: %s", self.rank, step, error
                )
            else:
                logger.warning(
                    "rank %s: writing checkpoint step %s failed: %s", self.rank, step, error
                )
        gathered = self.gather((error, records))
        outcome: list[Any] = [None]
        if self.rank == 0:
            outcome[0] = self._commit_or_discard(step, path, gathered, marks or {})
        if self.pg is not None:
            dist.broadcast_object_list(outcome, src=0, group=self.pg)
        committed, error_all = outcome[0]
        return bool(committed), error_all

    def gather(self, obj: Any) -> list[Any]:
        if self.pg is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def _new_filesystem(self, step: int) -> ChecksummingFileSystem:
        if self.fs_factory is not None:
            return self.fs_factory()
        if self.faults.applies(step, self.rank):
            return ChecksummingFileSystem(
                fail_after_bytes=self.faults.enospc_after_bytes,
                kill_after_bytes=self.faults.kill_after_bytes,
            )
        return ChecksummingFileSystem()

    def _commit_or_discard(
        self,
        step: int,
        path: str,
        gathered: list[tuple[str | None, dict[str, Any]]],
        marks: dict[str, str],
    ) -> tuple[bool, str | None]:
        errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e]
        if errors:
            self.storage.remove(path)  # never committed; older checkpoints are untouched
            return False, "; ".join(errors)
        files: dict[str, dict[str, int]] = {}
        for _, recs in gathered:
            for name, (size, crc) in recs.items():
                files[name] = {"size": size, "crc32": crc}
        if "://" in self.root:  # fsspec writers do not report checksums: read back
            for name in self.storage.list_dir(path):
                size, crc = self.storage.checksum(f"{path}/{name}")
                files[name] = {"size": size, "crc32": crc}
        manifest = mf.Manifest(
            step=step, world_size=self.world_size, files=files, versions=mf.versions(), extra=marks
        )
        try:
            self.faults.point("before_manifest", step, self.rank)
            mf.commit(self.storage, self.root, manifest)
        except OSError as e:
            # never remove a checkpoint whose manifest made it in (the rename is the commit)
            if mf.read_manifest(self.storage, path) is not None:
                logger.warning("checkpoint step %s committed despite: %s", step, e)
                return True, None
            self.storage.remove(path)
            return False, f"commit: {e}"
        try:
            self.faults.point("committed", step, self.rank)
        except OSError as e:  # after the commit: nothing to undo, ever
            logger.warning("checkpoint step %s committed; after the commit: %s", step, e)
        return True, None

    def retention(self) -> None:
        committed = mf.committed_steps(self.storage, self.root)
        victims = mf.retention_victims(
            committed,
            keep_last=self.config.keep_last,
            keep_every_steps=self.config.keep_every_steps,
        )
        for s in victims:
            p = self.step_path(s)
            self.storage.remove(f"{p}/{mf.MANIFEST}")
            self.faults.point("retention", s, self.rank)
            self.storage.remove(p)
