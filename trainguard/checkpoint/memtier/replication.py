"""Replication between agents: push this node's newest snapshots to the next node, and fill
local ranks that have none from the replicas held here or from the other agents."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.checkpoint.memtier.store import KEEP, TierStore, dir_stamp
from trainguard.checkpoint.memtier.wire import ProtocolError, fetch_snapshot, push_snapshot
from trainguard.checkpoint.staging import list_snapshots

__all__ = ["Replicator", "collect"]

logger = logging.getLogger(__name__)

Peers = dict[int, dict[str, Any]]
"""Group rank → ``{"host", "port", "node"}`` of the other agents of the round."""


class Replicator:
    """A daemon thread pushing each local rank's newest own snapshot to the next node
    (group rank + 1) once; :meth:`set_peers` after every rendezvous.

    A failed push backs off exponentially (``backoff_s`` doubling up to ``backoff_max_s``)
    before that peer is tried again; ``failures`` counts them, each one is an event
    ``checkpoint_peer_push_failed`` (``emit``)."""

    def __init__(
        self,
        store: TierStore,
        *,
        node: str,
        interval_s: float = 0.01,
        backoff_s: float = 0.5,
        backoff_max_s: float = 60.0,
        emit: Callable[..., object] | None = None,
    ) -> None:
        self.store = store
        self.node = node
        self.interval_s = interval_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.emit = emit
        self.group_rank = 0
        self.peers: Peers = {}
        self.secret: bytes | None = None
        self.failures = 0
        """Failed pushes since the start (all peers)."""
        self.attempts = 0
        """Pushes started since the start."""
        self._streak = 0
        self._retry_at = 0.0
        self._pushed: dict[int, str] = {}
        self._seen: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tg-memtier-push", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def set_peers(self, group_rank: int, peers: Peers, secret: bytes | None = None) -> None:
        with self._lock:
            self.group_rank = group_rank
            self.peers = peers
            if secret is not None:
                self.secret = secret
            self._pushed.clear()
            self._seen.clear()
            self._streak = 0
            self._retry_at = 0.0

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                peers, secret = self.peers, self.secret
                if not peers or secret is None or time.monotonic() < self._retry_at:
                    continue
                ring = sorted(peers)  # the next peer after this node, wrapping around
                target_rank = next((r for r in ring if r > self.group_rank), ring[0])
            peer = peers.get(target_rank)
            if peer is not None:
                self._push_new(peer, secret)

    def _push_new(self, peer: dict[str, Any], secret: bytes) -> None:
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
            self.attempts += 1
            try:
                push_snapshot((peer["host"], peer["port"]), snap, secret=secret, node=self.node)
                self._pushed[snap.rank] = snap.gen
                self._streak = 0
            except (OSError, ProtocolError) as e:
                self._seen.pop(name, None)
                self._failed(peer, snap.rank, e)
                return  # the peer is unwell: no more pushes to it before the backoff

    def _failed(self, peer: dict[str, Any], rank: int, e: BaseException) -> None:
        self.failures += 1
        self._streak += 1
        delay = min(self.backoff_max_s, self.backoff_s * 2 ** (self._streak - 1))
        self._retry_at = time.monotonic() + delay
        logger.debug("replicating rank %s to %s failed: %s", rank, peer.get("node"), e)
        if self.emit is not None:
            self.emit(
                "checkpoint_peer_push_failed",
                peer=peer.get("node"),
                rank=rank,
                error=str(e)[:200],
                failures=self.failures,
                consecutive=self._streak,
                retry_in_s=round(delay, 3),
            )


def collect(
    store: TierStore,
    peers: Peers,
    rank: int,
    world_size: int,
    *,
    secret: bytes | None,
    deadline: float,
    max_bytes: int,
    skipped: dict[int, str] | None = None,
) -> list[tuple[str, dict[str, Any], Path]]:
    """The newest ``KEEP`` snapshots of ``rank`` this node holds as replicas or, else, the
    other agents hold, newest first, as ``(source, meta, file)``: each ``file`` a new complete
    copy in the tier, for :meth:`TierStore.place`. Stops at ``deadline``; a peer that fails or
    times out goes into ``skipped`` (group rank → reason) and is not asked again."""
    skipped = {} if skipped is None else skipped
    out: list[tuple[str, dict[str, Any], Path]] = []
    below: int | None = None
    while len(out) < KEEP and time.monotonic() < deadline:
        snap = store.find_snapshot(rank, world_size, below=below, replica_only=True)
        if snap is not None:
            tmp = store.incoming()
            try:
                _copy(snap.bin_path, tmp, int(snap.meta["nbytes"]))
                if not snap.still_valid():
                    raise OSError("changed while copied")
            except OSError:
                tmp.unlink(missing_ok=True)
                below = snap.step  # look at the older ones
                continue
            out.append(("replica", dict(snap.meta), tmp))
            below = snap.step
            continue
        got = None
        for grank, peer in peers.items():
            if grank in skipped or secret is None:
                continue
            tmp = store.incoming()
            try:
                meta = fetch_snapshot(
                    (peer["host"], peer["port"]),
                    secret=secret,
                    rank=rank,
                    world_size=world_size,
                    below=below,
                    dest=tmp,
                    max_bytes=min(max_bytes, store.free_bytes()),
                    deadline=deadline,
                )
            except (OSError, ProtocolError) as e:
                tmp.unlink(missing_ok=True)
                skipped[grank] = f"{type(e).__name__}: {e}"[:200]
                logger.warning("fetching rank %s from %s failed: %s", rank, peer.get("node"), e)
                continue
            if meta is not None:
                meta = dict(meta)
                if not str(meta.get("source", "")).startswith("peer"):
                    meta["source"] = f"peer:{peer['node']}"
                got = (f"peer:{peer['node']}", meta, tmp)
                break
        if got is None:
            break
        out.append(got)
        below = got[1]["step"]
    return out


def _copy(src: Path, dst: Path, nbytes: int) -> None:
    """Copy ``nbytes`` of ``src`` into the new file ``dst`` in the kernel."""
    with open(src, "rb") as fi, open(dst, "xb") as fo:
        left = nbytes
        while left:
            k = os.sendfile(fo.fileno(), fi.fileno(), nbytes - left, left)
            if k <= 0:
                raise OSError(f"{src}: short read")
            left -= k
