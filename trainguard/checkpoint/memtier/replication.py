"""Replication between agents: push this node's newest snapshots to the next node, and fill
local ranks that have none from the replicas held here or from the other agents."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from trainguard.checkpoint.memtier.store import KEEP, TierStore, dir_stamp, read_snapshot
from trainguard.checkpoint.memtier.wire import fetch_snapshot, push_snapshot
from trainguard.checkpoint.staging import list_snapshots

__all__ = ["Replicator", "collect"]

logger = logging.getLogger(__name__)

Peers = dict[int, dict[str, Any]]
"""Group rank → ``{"host", "port", "node"}`` of the other agents of the round."""


class Replicator:
    """A daemon thread pushing each local rank's newest own snapshot to the next node
    (group rank + 1) once; :meth:`set_peers` after every rendezvous."""

    def __init__(self, store: TierStore, *, node: str, interval_s: float = 0.01) -> None:
        self.store = store
        self.node = node
        self.interval_s = interval_s
        self.group_rank = 0
        self.peers: Peers = {}
        self._pushed: dict[int, str] = {}
        self._seen: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tg-memtier-push", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def set_peers(self, group_rank: int, peers: Peers) -> None:
        with self._lock:
            self.group_rank = group_rank
            self.peers = peers
            self._pushed.clear()
            self._seen.clear()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.peers:
                continue
            ring = sorted(self.peers)  # the next peer after this node, wrapping around
            target_rank = next((r for r in ring if r > self.group_rank), ring[0])
            peer = self.peers.get(target_rank)
            if peer is not None:
                self._push_new(peer)

    def _push_new(self, peer: dict[str, Any]) -> None:
        local = self.store.local
        try:
            names = os.listdir(local)
        except OSError:
            return
        for name in names:
            if not name.startswith("rank_"):
                continue
            stamp = dir_stamp(local / name)
            if stamp is None or self._seen.get(name) == stamp:
                continue  # nothing new: skip parsing the metadata
            self._seen[name] = stamp
            snaps = list_snapshots(local / name)
            if not snaps or snaps[0].source.startswith("peer"):
                continue
            snap = snaps[0]
            if self._pushed.get(snap.rank) == snap.gen:
                continue
            data = read_snapshot(snap)
            if data is None:
                self._seen.pop(name, None)  # changed while read: look again
                continue
            try:
                push_snapshot((peer["host"], peer["port"]), snap, data, node=self.node)
                self._pushed[snap.rank] = snap.gen
            except OSError as e:
                self._seen.pop(name, None)
                logger.debug("replicating rank %s to %s failed: %s", snap.rank, peer, e)


Fetch = Callable[..., "tuple[dict[str, Any], bytearray] | None"]


def collect(
    store: TierStore, peers: Peers, rank: int, world_size: int, *, fetch: Fetch = fetch_snapshot
) -> list[tuple[str, dict[str, Any], Any]]:
    """The newest ``KEEP`` snapshots of ``rank`` this node holds as replicas or, else, the
    other agents hold, newest first, as ``(source, meta, bytes)``."""
    out: list[tuple[str, dict[str, Any], Any]] = []
    below: int | None = None
    while len(out) < KEEP:
        found = store.find(rank, world_size, below=below)
        if found is not None:
            out.append(("replica", dict(found[0].meta), found[1]))
            below = found[0].step
            continue
        fetched = None
        for peer in peers.values():
            try:
                fetched = fetch(
                    (peer["host"], peer["port"]), rank=rank, world_size=world_size, below=below
                )
            except OSError as e:
                logger.warning("fetching rank %s from %s failed: %s", rank, peer, e)
                continue
            if fetched is not None:
                meta, data = fetched
                if not str(meta.get("source", "")).startswith("peer"):
                    meta["source"] = f"peer:{peer['node']}"
                out.append((f"peer:{peer['node']}", meta, data))
                below = meta["step"]
                break
        if fetched is None:
            break
    return out
