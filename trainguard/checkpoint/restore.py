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
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.staging import flatten, list_snapshots, rank_dir, ref_paths, unflatten
from trainguard.checkpoint.state import apply_state, build_state_dict, rng_key, set_rng_state
from trainguard.core.config.checkpoint import writer_threads

if TYPE_CHECKING:
    from trainguard.checkpoint.manager import CheckpointManager

__all__ = ["restore"]

logger = logging.getLogger(__name__)


def _all_ok(mgr: CheckpointManager, ok: bool) -> bool:
    if mgr._pg is None:
        return ok
    t = torch.tensor([0 if ok else 1], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mgr._pg)
    return int(t.item()) == 0


def _gather(mgr: CheckpointManager, obj: Any) -> list[Any]:
    return mgr._writer.gather(obj)


def _broadcast(mgr: CheckpointManager, obj: Any) -> Any:
    if mgr._pg is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=mgr._pg)
    return box[0]


def restore(
    mgr: CheckpointManager, state: MutableMapping[str, Any], *, use_memory: bool = True
) -> int | None:
    t0 = time.perf_counter()
    mem = {}
    if use_memory and mgr.memory_dir is not None:
        for snap in list_snapshots(rank_dir(mgr.memory_dir, mgr.rank)):
            if snap.world_size == mgr.world_size and snap.rank == mgr.rank:
                mem.setdefault(snap.step, snap)
    per_rank = _gather(mgr, sorted(mem))
    common = set(per_rank[0]).intersection(*map(set, per_rank[1:])) if per_rank else set()
    disk = _broadcast(mgr, mf.committed_steps(mgr.storage, mgr.root) if mgr.rank == 0 else None)
    for step in sorted(common | set(disk), reverse=True):
        if step in common:
            loaded, source, err = None, "memory", None
            try:
                snap = mem[step]
                skeleton, tensors = snap.load(into=_live_tensors(state))
                loaded = unflatten(skeleton, tensors)
                source = "peer_memory" if snap.source.startswith("peer") else "memory"
            except (OSError, ValueError, KeyError) as e:
                err = f"{type(e).__name__}: {e}"
            if _all_ok(mgr, loaded is not None):
                assert loaded is not None
                _apply(mgr, state, loaded)
                _restored(mgr, step, source, t0, peer=mem[step].source)
                return step
            if err:
                logger.warning("memory snapshot of step %s unusable: %s", step, err)
        if step in disk:
            if _load_disk(mgr, state, step):
                _restored(mgr, step, "disk", t0)
                return step
    if mgr.rank == 0:
        mgr._emit(
            "checkpoint_restored",
            step=None,
            source="none",
            duration_s=round(time.perf_counter() - t0, 4),
            memory_steps=per_rank,
            disk_steps=disk,
        )
    return None


def _live_tensors(state: MutableMapping[str, Any]) -> dict[tuple[Any, ...], torch.Tensor]:
    """Key path → the live tensor (parameter / optimizer state) a state dict entry aliases."""
    skeleton, tensors = flatten(build_state_dict(state))
    return {path: tensors[i] for i, path in ref_paths(skeleton).items()}


def _apply(mgr: CheckpointManager, state: MutableMapping[str, Any], loaded: dict[str, Any]) -> None:
    apply_state(state, loaded)
    blob = loaded.get(rng_key(mgr.rank))
    if mgr.config.capture_rng and blob is not None:
        set_rng_state(blob)


def _restored(
    mgr: CheckpointManager, step: int, source: str, t0: float, *, peer: str | None = None
) -> None:
    dt = time.perf_counter() - t0
    fields: dict[str, Any] = {"step": step, "source": source, "duration_s": round(dt, 4)}
    if source == "peer_memory" and peer:
        fields["peer"] = peer.partition(":")[2]
    mgr._emit("checkpoint_restored", rank=mgr.rank, **fields)
    mgr._metric(step=step, checkpoint_restore_s=dt)
    logger.info("rank %s restored step %s from %s in %.3f s", mgr.rank, step, source, dt)


def _load_disk(mgr: CheckpointManager, state: MutableMapping[str, Any], step: int) -> bool:
    import torch.distributed.checkpoint as dcp

    path = f"{mgr.root.rstrip('/')}/{mf.step_dir_name(step)}"
    manifest = mf.read_manifest(mgr.storage, path)
    err: str | None = None
    if manifest is None:
        err = "manifest vanished"
    elif mgr.config.verify_checksums:
        names = sorted(manifest.files)[mgr.rank :: mgr.world_size]
        try:
            mf.verify(mgr.storage, path, manifest, names, threads=writer_threads(mgr.config))
        except mf.VerifyError as e:
            err = str(e)
    if not _all_ok(mgr, err is None):
        errors = [e for e in _gather(mgr, err) if e]
        if mgr.rank == 0:
            mgr._emit("checkpoint_corrupt", step=step, path=path, error="; ".join(errors))
        logger.warning("checkpoint step %s is bad (%s); falling back", step, "; ".join(errors))
        return False
    assert manifest is not None
    target = build_state_dict(state)
    target["_trainguard_step"] = step
    if "://" in mgr.root:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader: Any = FsspecReader(path)
    else:
        reader = dcp.FileSystemReader(path)
    keys = set(reader.read_metadata().state_dict_metadata)
    rk = rng_key(mgr.rank)
    if mgr.config.capture_rng and manifest.world_size == mgr.world_size and rk in keys:
        target[rk] = b""
    try:
        dcp.load(target, storage_reader=reader, process_group=mgr._pg, no_dist=mgr._pg is None)
        ok = True
    except (Exception, CheckpointException) as e:
        logger.warning("loading checkpoint step %s failed: %s", step, e)
        ok = False
    if not _all_ok(mgr, ok):
        if mgr.rank == 0:
            mgr._emit("checkpoint_corrupt", step=step, path=path, error="load failed")
        return False
    _apply(mgr, state, target)
    return True
