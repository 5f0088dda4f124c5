"""The agent plugin that owns the node's memory tier (see the package docstring)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup

from trainguard.checkpoint.memtier.replication import Peers, Replicator, collect
from trainguard.checkpoint.memtier.secret import load_secret_file, store_secret
from trainguard.checkpoint.memtier.server import TierServer
from trainguard.checkpoint.memtier.store import TierStore
from trainguard.checkpoint.memtier.sweep import TIER_PREFIX, hold_owner_lock, remove_orphans
from trainguard.core.contracts.envvars import CHECKPOINT_MEMORY_DIR as MEMORY_DIR_ENV
from trainguard.core.plugin import AgentContext, AgentPlugin
from trainguard.core.storeutil import gather

__all__ = ["MemoryTierPlugin"]

PEER_WAIT_S = 10.0
"""How long a node waits after the rendezvous for its peers' memory-tier addresses."""

logger = logging.getLogger(__name__)


class MemoryTierPlugin(AgentPlugin):
    """Creates the tier, exports it to the workers, serves and replicates it, fills ranks
    before their workers start, and removes it at the end."""

    name = "checkpoint_memory_tier"

    def __init__(self, ctx: AgentContext) -> None:
        self.cfg = cfg = ctx.config.checkpoint
        self.events = ctx.events
        self.node = ctx.node
        root = cfg.memory_root if os.path.isdir(cfg.memory_root) else None
        remove_orphans(Path(root or tempfile.gettempdir()))
        self.dir = Path(tempfile.mkdtemp(prefix=f"{TIER_PREFIX}{os.getpid()}-", dir=root))
        self._owner_fd: int | None = hold_owner_lock(self.dir)  # held while this agent lives
        self.store = TierStore(self.dir)
        self.local = self.store.local
        self.replica = self.store.replica
        self.group_rank = 0
        self.peers: Peers = {}
        self._server: TierServer | None = None
        self._replicator: Replicator | None = None
        self.secret: bytes | None = None
        self._file_secret: bytes | None = None
        self._entitled: set[int] = set()
        max_bytes = cfg.peer_max_snapshot_bytes or 1 << 62  # None: the free space bounds it
        self._max_bytes = max_bytes
        if cfg.peer_replication and cfg.memory_secret_file:
            self._file_secret = load_secret_file(cfg.memory_secret_file, run_id=ctx.run_id)
        if cfg.peer_replication:
            host = cfg.peer_host or route_ip(ctx.rdzv_endpoint)
            self._server = TierServer(
                (host, cfg.peer_port),
                self.store,
                max_header=cfg.peer_max_header_bytes,
                max_bytes=max_bytes,
            )
            self._server.start()
            self._announced = False  # the event follows the agent's `launch` (first hook)
            self._replicator = Replicator(
                self.store,
                node=self.node,
                backoff_s=cfg.peer_backoff_s,
                backoff_max_s=cfg.peer_backoff_max_s,
                emit=ctx.events.emit,
            )
            self._replicator.start()

    # -- hooks -----------------------------------------------------------------------------------
    def worker_env(self, ctx: AgentContext) -> dict[str, str]:
        """The workers stage their snapshots into this node's tier directory."""
        return {MEMORY_DIR_ENV: str(self.local)}

    def before_rendezvous(self, ctx: AgentContext) -> None:
        if self._server is not None and not self._announced:
            self._announced = True
            ctx.events.emit(
                "checkpoint_memory_tier_serving", host=self._server.host, port=self._server.port
            )

    def after_rendezvous(self, ctx: AgentContext, group: WorkerGroup) -> None:
        # torch fills both (and the store) in every rendezvous round
        assert group.group_rank is not None and group.group_world_size is not None
        self.group_rank = group.group_rank
        world = group.group_world_size
        if self._server is not None and world > 1:
            self.secret = self._file_secret or store_secret(group.store)
            self._server.set_secret(self.secret)
        ranks = [w.global_rank for w in group.workers]
        world_size = group.workers[0].world_size if group.workers else 0
        self.peers = self._exchange_addresses(ctx, group, world, ranks)
        entitled = self._entitle(world_size)
        if self._replicator is not None:
            self._replicator.set_peers(self.group_rank, self.peers, self.secret)
        self._fill(ranks, world_size)
        # replicas this node may still be asked for: the ranks it replicates now and those it
        # replicated in the round before (a fill of their new node may be under way)
        keep = entitled | self._entitled
        self._entitled = entitled
        if self._server is not None:
            pruned = self.store.prune_replicas(keep, world_size)
            if pruned:
                logger.info("memory tier: pruned replicas of ranks %s", pruned)

    def _entitle(self, world_size: int) -> set[int]:
        """The ranks the previous node of the ring (the one that pushes here) may push: its
        own, as it published them. Every other push is refused."""
        if self._server is None or not self.peers:
            return set()
        ring = sorted({*self.peers, self.group_rank})
        prev = ring[(ring.index(self.group_rank) - 1) % len(ring)]
        peer = self.peers.get(prev, {})
        entitled = {int(r) for r in peer.get("ranks", []) if type(r) is int}
        self._server.set_entitled(entitled, world_size)
        return entitled

    def _exchange_addresses(
        self, ctx: AgentContext, group: WorkerGroup, world: int, ranks: list[int]
    ) -> Peers:
        """Publish this agent's server in the rendezvous store, read the others' (waiting at
        most :data:`PEER_WAIT_S` for them)."""
        if self._server is None or world <= 1:
            return {}
        host = self._server.host
        if host in ("0.0.0.0", "::", ""):  # bound to every interface on purpose (peer_host)
            host = route_ip(ctx.rdzv_endpoint)
        me = {"host": host, "port": self._server.port, "node": self.node, "ranks": ranks}
        prefix = f"trainguard/ckpt_memtier/{ctx.attempt}/"
        assert group.store is not None
        group.store.set(f"{prefix}{self.group_rank}", json.dumps(me))
        others = [r for r in range(world) if r != self.group_rank and r not in ctx.foreign_ranks]
        got = gather(group.store, [f"{prefix}{r}" for r in others], timeout_s=PEER_WAIT_S)
        peers = {r: json.loads(got[f"{prefix}{r}"]) for r in others if f"{prefix}{r}" in got}
        missing = [r for r in others if r not in peers]
        if missing:  # dead since the round: never waited for again
            ctx.events.emit("checkpoint_peer_skipped", group_ranks=missing, wait_s=PEER_WAIT_S)
        return peers

    def _fill(self, ranks: list[int], world_size: int) -> None:
        """Give every local rank without a snapshot the newest ones this node holds as
        replicas, or else the other agents hold; all of it within ``peer_fetch_timeout_s``
        (a peer that fails or does not answer in time is skipped: event)."""
        deadline = time.monotonic() + self.cfg.peer_fetch_timeout_s
        skipped: dict[int, str] = {}
        for r in ranks:
            if self.store.has_local(r, world_size):
                continue
            if time.monotonic() >= deadline:
                self.events.emit(
                    "checkpoint_memory_fill_timeout",
                    rank=r,
                    timeout_s=self.cfg.peer_fetch_timeout_s,
                )
                continue
            t0 = time.monotonic()
            got = collect(
                self.store,
                self.peers,
                r,
                world_size,
                secret=self.secret,
                deadline=deadline,
                max_bytes=self._max_bytes,
                skipped=skipped,
            )
            nbytes = sum(int(m["nbytes"]) for _, m, _ in got)
            for _, meta, tmp in reversed(got):
                try:
                    self.store.place("local", meta, tmp)
                finally:
                    tmp.unlink(missing_ok=True)
            if got:
                self.events.emit(
                    "checkpoint_memory_filled",
                    rank=r,
                    steps=[m["step"] for _, m, _ in got],
                    step=got[0][1]["step"],
                    source=got[0][0],
                    snapshot_source=got[0][1].get("source"),
                    bytes=nbytes,
                    duration_s=round(time.monotonic() - t0, 4),
                )
        if skipped:
            self.events.emit(
                "checkpoint_peer_skipped",
                group_ranks=sorted(skipped),
                reasons={str(k): v for k, v in skipped.items()},
                during="fill",
            )

    def find(self, rank: int, world_size: int, *, below: int | None = None) -> Any:
        return self.store.find(rank, world_size, below=below)

    def close(self) -> None:
        if self._replicator is not None:
            self._replicator.stop()
        if self._server is not None:
            self._server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None


def route_ip(endpoint: str) -> str:
    """This host's address on the route to the rendezvous ``endpoint`` (``host:port``);
    127.0.0.1 for a loopback or missing endpoint. A name that resolves to loopback only here
    (a node's own hostname mapped to 127.0.1.1 in /etc/hosts) gets the default route's address,
    which is what the other nodes reach this host at."""
    host = endpoint.rsplit(":", 1)[0].strip("[]") if endpoint else ""
    if host in ("", "localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    try:
        target = socket.getaddrinfo(host, 29400, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        if str(target[0]).startswith("127."):
            target = ("192.0.2.1", 9)  # TEST-NET: the interface of the default route
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(target)  # no packet is sent: only picks the outgoing interface
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
