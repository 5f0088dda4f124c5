"""The memory tier's files: this node's own snapshots (``local/``, written by its workers) and
the replicas other agents pushed here (``replica/``), one directory per rank in each."""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

from trainguard.checkpoint.staging import Snapshot, list_snapshots, rank_dir
from trainguard.core.atomicfile import write_atomic

__all__ = [
    "KEEP",
    "TierStore",
    "dir_stamp",
    "place_snapshot",
    "read_snapshot",
    "write_snapshot",
]

KEEP = 3
"""Snapshots per rank kept when storing replicas or fetched copies (replication may lag)."""


def read_snapshot(snap: Snapshot) -> bytes | None:
    """The snapshot's bytes, or None if it changed while being read."""
    try:
        data = snap.bin_path.read_bytes()[: int(snap.meta["nbytes"])]
    except OSError:
        return None
    return data if snap.still_valid() else None


def place_snapshot(directory: Path, meta: dict[str, Any], bin_file: Path) -> Path | None:
    """Make the complete file ``bin_file`` (same file system) the snapshot ``meta`` in the
    oldest of ``KEEP`` slots of ``directory``: bytes first, meta last (a crash in between leaves
    no meta, so no snapshot). None (and ``bin_file`` removed) if that step is already there."""
    directory.mkdir(parents=True, exist_ok=True)
    steps = {s.meta_path.stem: s.step for s in list_snapshots(directory)}
    if any(v == meta["step"] for v in steps.values()):
        bin_file.unlink(missing_ok=True)
        return None
    names = [f"slot{i}" for i in range(KEEP)]
    name = next((n for n in names if n not in steps), None) or min(names, key=lambda n: steps[n])
    meta_path = directory / f"{name}.json"
    meta_path.unlink(missing_ok=True)
    os.replace(bin_file, directory / f"{name}.bin")
    write_atomic(meta_path, json.dumps(meta))
    return meta_path


def write_snapshot(directory: Path, meta: dict[str, Any], data: bytes | bytearray) -> Path | None:
    """:func:`place_snapshot` for bytes held in memory."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = write_atomic(directory / f".incoming-{uuid.uuid4().hex}.bin", data)
    return place_snapshot(directory, meta, tmp)


def dir_stamp(d: Path) -> tuple[tuple[str, int], ...] | None:
    """(name, mtime) of the snapshot metadata files: changes whenever a snapshot is published."""
    try:
        return tuple(
            sorted(
                (e.name, e.stat().st_mtime_ns) for e in os.scandir(d) if e.name.endswith(".json")
            )
        )
    except OSError:
        return None


class TierStore:
    """The tier's two directories under ``root`` (created here)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.local = root / "local"
        self.replica = root / "replica"
        self.local.mkdir(exist_ok=True)
        self.replica.mkdir(exist_ok=True)
        self._lock = threading.Lock()

    def incoming(self) -> Path:
        """A new temporary file name in the tier (same file system as the slots) for a
        snapshot being received; invisible to :func:`list_snapshots` until placed."""
        return self.root / f".incoming-{uuid.uuid4().hex}.bin"

    def prune_replicas(self, keep: set[int], world_size: int) -> list[int]:
        """Remove the replicas of ranks not in ``keep`` and those of another world size (no
        restore of this job can use them); the ranks whose replicas went."""
        gone = []
        with self._lock:
            try:
                names = os.listdir(self.replica)
            except OSError:
                return []
            for name in names:
                try:
                    rank = int(name.removeprefix("rank_"))
                except ValueError:
                    continue
                d = self.replica / name
                if rank not in keep:
                    shutil.rmtree(d, ignore_errors=True)
                    gone.append(rank)
                    continue
                for snap in list_snapshots(d):
                    if snap.world_size != world_size:
                        snap.meta_path.unlink(missing_ok=True)
                        snap.bin_path.unlink(missing_ok=True)
        return sorted(gone)

    def free_bytes(self) -> int:
        """Free space of the tier's file system."""
        return shutil.disk_usage(self.root).free

    def place(self, kind: str, meta: dict[str, Any], bin_file: Path) -> Path | None:
        """Move the received ``bin_file`` into a slot of ``kind`` (``"replica"``: another
        agent pushed it; ``"local"``: a fill for a local rank)."""
        base = self.replica if kind == "replica" else self.local
        with self._lock:
            return place_snapshot(rank_dir(base, int(meta["rank"])), meta, bin_file)

    def has_local(self, rank: int, world_size: int) -> bool:
        return any(s.world_size == world_size for s in list_snapshots(rank_dir(self.local, rank)))

    def find_snapshot(
        self, rank: int, world_size: int, *, below: int | None = None, replica_only: bool = False
    ) -> Snapshot | None:
        """This node's newest complete snapshot of ``rank`` (own or replica) older than
        ``below``, without reading its bytes (a reader checks ``still_valid()`` after)."""
        snaps = list_snapshots(rank_dir(self.replica, rank))
        if not replica_only:
            snaps += list_snapshots(rank_dir(self.local, rank))
        for snap in sorted(snaps, key=lambda s: -s.step):
            if snap.world_size != world_size or (below is not None and snap.step >= below):
                continue
            try:
                if snap.bin_path.stat().st_size >= int(snap.meta["nbytes"]):
                    return snap
            except (OSError, ValueError, KeyError):
                continue
        return None

    def find(
        self, rank: int, world_size: int, *, below: int | None = None
    ) -> tuple[Snapshot, bytes] | None:
        """This node's newest intact snapshot of ``rank`` (own or replica), older than ``below``."""
        snaps = list_snapshots(rank_dir(self.local, rank)) + list_snapshots(
            rank_dir(self.replica, rank)
        )
        for snap in sorted(snaps, key=lambda s: -s.step):
            if snap.world_size != world_size or (below is not None and snap.step >= below):
                continue
            data = read_snapshot(snap)
            if data is not None:
                return snap, data
        return None
