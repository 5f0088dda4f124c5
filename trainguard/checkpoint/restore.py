"""Restore: the newest step every rank can load, from the memory tier or from disk.

Candidates are the steps whose memory-tier snapshot exists on *every* rank (same world size)
and the committed steps on disk. Newest first: a memory snapshot is loaded if every rank reads
it intact; a disk checkpoint is loaded (DCP, resharding to this world size) if every rank
verified its share of the files against the manifest's checksums. A bad one is reported as a
``checkpoint_corrupt`` event and the next older candidate is tried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.staging import (
    Snapshot,
    file_digest,
    flatten,
    list_snapshots,
    rank_dir,
    ref_paths,
    unflatten,
)
from trainguard.checkpoint.state import apply_state, build_state_dict, rng_key, set_rng_state
from trainguard.checkpoint.storage import Storage
from trainguard.core.config.checkpoint import CheckpointConfig, writer_threads

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Restorer"]

logger = logging.getLogger(__name__)


@dataclass
class Restorer:
    """One restore of one rank; what it needs is handed over by the manager
    (:meth:`trainguard.checkpoint.CheckpointManager.restore` is the public entry)."""

    config: CheckpointConfig
    rank: int
    world_size: int
    root: str
    storage: Storage
    memory_dir: Path | None
    pg: ProcessGroup | None
    """The checkpoint gloo group (None: one process)."""
    gather: Callable[[Any], list[Any]]
    emit: Callable[..., object]
    metric: Callable[..., object]
    max_step: int | None = None
    """Only steps at or before it (a rollback); None: any."""
    min_step: int | None = None
    """Only steps at or after it (a framework's own checkpoint already holds older ones);
    None: any."""

    # -- collectives ---------------------------------------------------------------------------
    def _all_ok(self, ok: bool) -> bool:
        if self.pg is None:
            return ok
        t = torch.tensor([0 if ok else 1], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return int(t.item()) == 0

    def _broadcast(self, obj: Any) -> Any:
        if self.pg is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    # -- restore -------------------------------------------------------------------------------
    def run(self, state: MutableMapping[str, Any], *, use_memory: bool = True) -> int | None:
        """Load the newest step every rank can load into ``state``; its number, or None."""
        t0 = time.perf_counter()
        mem: dict[int, Snapshot] = {}
        if use_memory and self.memory_dir is not None:
            for snap in list_snapshots(rank_dir(self.memory_dir, self.rank)):
                if snap.world_size == self.world_size and snap.rank == self.rank:
                    mem.setdefault(snap.step, snap)
        per_rank = self.gather(sorted(mem))
        common = set(per_rank[0]).intersection(*map(set, per_rank[1:])) if per_rank else set()
        # rank 0 lists the committed steps for everyone; a rank without a process group (no
        # torch.distributed in the script) lists them itself
        disk = self._broadcast(
            mf.committed_steps(self.storage, self.root)
            if self.rank == 0 or self.pg is None
            else None
        )
        for step in sorted(common | set(disk), reverse=True):
            if self.max_step is not None and step > self.max_step:
                continue
            if self.min_step is not None and step < self.min_step:
                break
            if step in common:
                snap = mem[step]
                source = "peer_memory" if snap.source.startswith("peer") else "memory"
                err = self._load_memory(state, snap)
                if self._all_ok(err is None):
                    self._restored(step, source, t0, peer=snap.source)
                    return step
                if err:
                    self._refuse(snap, source, err)
            if step in disk:
                if self._load_disk(state, step):
                    self._restored(step, "disk", t0)
                    return step
        if self.rank == 0:
            self.emit(
                "checkpoint_restored",
                step=None,
                source="none",
                duration_s=round(time.perf_counter() - t0, 4),
                memory_steps=per_rank,
                disk_steps=disk,
            )
        return None

    def _load_memory(self, state: MutableMapping[str, Any], snap: Snapshot) -> str | None:
        """Load the memory snapshot ``snap`` into ``state``; None, or why it could not be.
        Never raises: whatever a snapshot holds (it may come from a peer), every rank must
        reach the vote that follows, or the others would wait in it."""
        try:
            if snap.source != "memory" and not self._copy_agrees(snap):
                return "sdc_suspect: the copy's bytes differ from its owner's digest"
            skeleton, tensors = snap.load(into=_live_tensors(state))
            self._apply(state, unflatten(skeleton, tensors))
        except Exception as e:  # noqa: BLE001 - see the docstring
            return f"{type(e).__name__}: {e}"[:500]
        return None

    def _copy_agrees(self, snap: Snapshot) -> bool:
        """A copy another node held (a replica pushed to it, a peer's fill) against the
        digest its owner wrote with it: a copy that differs (a bit flipped in that node's
        memory) is an ``sdc_suspect``, never restored from. A copy without a digest (an older
        writer) is taken as it is."""
        want = snap.meta.get("digest")
        if not isinstance(want, str):
            return True
        got = file_digest(snap.bin_path, int(snap.meta["nbytes"]))
        if got == want or not snap.still_valid():
            return True  # a snapshot replaced meanwhile is caught by the load
        self.emit(
            "sdc_suspect",
            step=snap.step,
            ranks=[self.rank],
            localise="memory_copy",
            source=snap.source,
            digests=[want, got],
        )
        return False

    def _refuse(self, snap: Snapshot, source: str, err: str) -> None:
        """One line and a ``checkpoint_corrupt`` event for this rank's unusable snapshot, which
        is dropped from the tier unless it changed meanwhile (then it is another snapshot)."""
        dropped = snap.still_valid()
        if dropped:
            snap.meta_path.unlink(missing_ok=True)
        logger.warning(
            "rank %s: %s snapshot of step %s refused (%s); trying the next source",
            self.rank,
            source,
            snap.step,
            err,
        )
        self.emit(
            "checkpoint_corrupt",
            rank=self.rank,
            step=snap.step,
            source=source,
            path=str(snap.meta_path),
            error=err,
            dropped=dropped,
        )

    def _apply(self, state: MutableMapping[str, Any], loaded: dict[str, Any]) -> None:
        apply_state(state, loaded)
        blob = loaded.get(rng_key(self.rank))
        if self.config.capture_rng and blob is not None:
            set_rng_state(blob)

    def _restored(self, step: int, source: str, t0: float, *, peer: str | None = None) -> None:
        dt = time.perf_counter() - t0
        fields: dict[str, Any] = {"step": step, "source": source, "duration_s": round(dt, 4)}
        if source == "peer_memory" and peer:
            fields["peer"] = peer.partition(":")[2]
        self.emit("checkpoint_restored", rank=self.rank, **fields)
        self.metric(step=step, checkpoint_restore_s=dt)
        logger.info("rank %s restored step %s from %s in %.3f s", self.rank, step, source, dt)

    def _load_disk(self, state: MutableMapping[str, Any], step: int) -> bool:
        import torch.distributed.checkpoint as dcp

        path = f"{self.root.rstrip('/')}/{mf.step_dir_name(step)}"
        manifest = mf.read_manifest(self.storage, path)
        err: str | None = None
        if manifest is None:
            err = "manifest vanished"
        elif self.config.verify_checksums:
            names = sorted(manifest.files)[self.rank :: self.world_size]
            try:
                mf.verify(self.storage, path, manifest, names, threads=writer_threads(self.config))
            except mf.VerifyError as e:
                err = str(e)
        if not self._all_ok(err is None):
            errors = [e for e in self.gather(err) if e]
            if self.rank == 0:
                self.emit("checkpoint_corrupt", step=step, path=path, error="; ".join(errors))
            logger.warning("checkpoint step %s is bad (%s); falling back", step, "; ".join(errors))
            return False
        assert manifest is not None
        target = build_state_dict(state)
        target["_trainguard_step"] = step
        if "://" in self.root:
            from trainguard.core._torch import fsspec_reader

            reader: Any = fsspec_reader(path)
        else:
            reader = dcp.FileSystemReader(path)
        keys = set(reader.read_metadata().state_dict_metadata)
        rk = rng_key(self.rank)
        if self.config.capture_rng and manifest.world_size == self.world_size and rk in keys:
            target[rk] = b""
        try:
            dcp.load(target, storage_reader=reader, process_group=self.pg, no_dist=self.pg is None)
            ok = True
        except (Exception, CheckpointException) as e:
            logger.warning("loading checkpoint step %s failed: %s", step, e)
            ok = False
        if not self._all_ok(ok):
            if self.rank == 0:
                self.emit("checkpoint_corrupt", step=step, path=path, error="load failed")
            return False
        self._apply(state, target)
        return True


def _live_tensors(state: MutableMapping[str, Any]) -> dict[tuple[Any, ...], torch.Tensor]:
    """Key path → the live tensor (parameter / optimizer state) a state dict entry aliases."""
    skeleton, tensors = flatten(build_state_dict(state))
    return {path: tensors[i] for i, path in ref_paths(skeleton).items()}
