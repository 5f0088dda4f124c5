"""The node's in-memory checkpoint tier, owned by the agent, replicated to one peer agent.

The agent plugin creates a directory in shared memory (``/dev/shm``) and exports it to its
workers (``TRAINGUARD_CHECKPOINT_MEMORY_DIR``). Workers stage their snapshots into files there
(see :mod:`trainguard.checkpoint.staging`), so a worker crash does not lose them: the agent
owns the directory and removes it only when it exits.

Replication: every agent runs a small TCP server. After each rendezvous the agents publish
their addresses in the rendezvous store; each agent pushes its workers' newest snapshots to the
next node (group rank + 1). Before workers start, an agent makes sure every local rank has a
snapshot: from its own directory, from the replicas it holds, or fetched from the other agents
(marked ``source: peer:<node>``, which the worker's restore reports as ``peer_memory``).

Wire format: a 4-byte big-endian header length, a JSON header, then ``nbytes`` raw bytes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import socketserver
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.checkpoint.staging import Snapshot, list_snapshots, rank_dir
from trainguard.core.config.checkpoint import CheckpointConfig
from trainguard.core.envvars import CHECKPOINT_MEMORY_DIR as MEMORY_DIR_ENV
from trainguard.core.plugin import AgentPlugin
from trainguard.core.storeutil import gather

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import WorkerGroup

    from trainguard.core.events import EventLog
    from trainguard.runtime.agent import TrainGuardAgent

PEER_WAIT_S = 10.0
"""How long a node waits after the rendezvous for its peers' memory-tier addresses."""

__all__ = ["MemoryTierPlugin", "fetch_snapshot", "push_snapshot"]

logger = logging.getLogger(__name__)

_TIMEOUT_S = 30.0
_KEEP = 3
"""Snapshots per rank kept when storing replicas or fetched copies (replication may lag)."""


# -- wire --------------------------------------------------------------------------------------
def _send(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    h = json.dumps(header).encode()
    sock.sendall(struct.pack(">I", len(h)) + h)
    if payload:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


def _recv(sock: socket.socket) -> tuple[dict[str, Any], bytearray]:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    header = json.loads(_recv_exact(sock, n))
    payload = _recv_exact(sock, int(header.get("nbytes", 0)))
    return header, payload


def _read_snapshot(snap: Snapshot) -> bytes | None:
    """The snapshot's bytes, or None if it changed while being read."""
    try:
        data = snap.bin_path.read_bytes()[: int(snap.meta["nbytes"])]
    except OSError:
        return None
    return data if snap.still_valid() else None


def _write_snapshot(directory: Path, meta: dict[str, Any], data: bytes | bytearray) -> Path:
    """Store a snapshot under ``directory`` in its oldest of ``_KEEP`` slots, bytes first, meta
    last (a crash in between leaves no meta, so no snapshot)."""
    directory.mkdir(parents=True, exist_ok=True)
    steps = {s.meta_path.stem: s.step for s in list_snapshots(directory)}
    if any(v == meta["step"] for v in steps.values()):
        return directory  # already there
    names = [f"slot{i}" for i in range(_KEEP)]
    name = next((n for n in names if n not in steps), None) or min(names, key=lambda n: steps[n])
    meta_path = directory / f"{name}.json"
    meta_path.unlink(missing_ok=True)
    tmp = directory / f".{name}.bin.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, directory / f"{name}.bin")
    tmp_meta = directory / f".{name}.json.tmp"
    tmp_meta.write_text(json.dumps(meta))
    os.replace(tmp_meta, meta_path)
    return meta_path


def push_snapshot(addr: tuple[str, int], snap: Snapshot, data: bytes, *, node: str) -> None:
    with socket.create_connection(addr, timeout=_TIMEOUT_S) as s:
        _send(s, {"op": "put", "node": node, "meta": snap.meta, "nbytes": len(data)}, data)
        header, _ = _recv(s)
        if not header.get("ok"):
            raise ConnectionError(f"peer refused snapshot: {header}")


def fetch_snapshot(
    addr: tuple[str, int], *, rank: int, world_size: int, below: int | None = None
) -> tuple[dict[str, Any], bytearray] | None:
    """The peer's newest snapshot of ``rank`` (older than step ``below`` if given)."""
    with socket.create_connection(addr, timeout=_TIMEOUT_S) as s:
        _send(s, {"op": "get", "rank": rank, "world_size": world_size, "below": below})
        header, payload = _recv(s)
    if not header.get("found"):
        return None
    return header["meta"], payload


# -- server ------------------------------------------------------------------------------------
class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        tier = self.server.tier
        try:
            header, payload = _recv(self.request)
            if header["op"] == "put":
                meta = dict(header["meta"])
                meta["source"] = f"peer:{header.get('node', '?')}"
                tier.store_replica(meta, payload)
                _send(self.request, {"ok": True})
            elif header["op"] == "get":
                found = tier.find(
                    int(header["rank"]), int(header["world_size"]), below=header.get("below")
                )
                if found is None:
                    _send(self.request, {"found": False})
                else:
                    snap, data = found
                    _send(
                        self.request, {"found": True, "meta": snap.meta, "nbytes": len(data)}, data
                    )
        except (OSError, ValueError, KeyError) as e:
            logger.warning("memory tier request from %s failed: %s", self.client_address, e)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], tier: MemoryTierPlugin) -> None:
        self.tier = tier
        super().__init__(addr, _Handler)


# -- plugin ------------------------------------------------------------------------------------
class MemoryTierPlugin(AgentPlugin):
    """Owns the node's memory tier; see the module docstring."""

    name = "checkpoint_memory_tier"

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, events: EventLog) -> None:
        self.cfg = cfg
        self.events = events
        root = cfg.memory_root if os.path.isdir(cfg.memory_root) else None
        _remove_orphans(Path(root or tempfile.gettempdir()))
        self.dir = Path(tempfile.mkdtemp(prefix=f"trainguard-ckpt-{os.getpid()}-", dir=root))
        self.local = self.dir / "local"
        self.replica = self.dir / "replica"
        self.local.mkdir()
        self.replica.mkdir()
        os.environ[MEMORY_DIR_ENV] = str(self.local)
        self.node = events.node
        self.group_rank = 0
        self.peers: dict[int, dict[str, Any]] = {}
        self._pushed: dict[int, str] = {}
        self._seen: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        if cfg.peer_replication:
            self._server = _Server(("0.0.0.0", 0), self)
            threading.Thread(
                target=self._server.serve_forever, name="tg-memtier-server", daemon=True
            ).start()
            self._thread = threading.Thread(
                target=self._replicate_loop, name="tg-memtier-push", daemon=True
            )
            self._thread.start()

    # -- server side -----------------------------------------------------------------------------
    def store_replica(self, meta: dict[str, Any], data: bytes | bytearray) -> None:
        with self._lock:
            _write_snapshot(rank_dir(self.replica, int(meta["rank"])), meta, data)

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
            data = _read_snapshot(snap)
            if data is not None:
                return snap, data
        return None

    # -- hooks -----------------------------------------------------------------------------------
    def after_rendezvous(self, agent: TrainGuardAgent, group: WorkerGroup) -> None:
        self.group_rank = group.group_rank
        world = group.group_world_size
        if self._server is not None and world > 1:
            host = self.cfg.peer_host or _host_ip()
            me = {"host": host, "port": self._server.server_address[1], "node": self.node}
            prefix = f"trainguard/ckpt_memtier/{agent.attempt}/"
            group.store.set(f"{prefix}{self.group_rank}", json.dumps(me))
            others = [r for r in range(world) if r != self.group_rank]
            got = gather(group.store, [f"{prefix}{r}" for r in others], timeout_s=PEER_WAIT_S)
            self.peers = {
                r: json.loads(got[f"{prefix}{r}"]) for r in others if f"{prefix}{r}" in got
            }
            missing = [r for r in others if r not in self.peers]
            if missing:
                # dead since the round, or not a trainguard agent: never waited for again
                self.events.emit("checkpoint_peer_skipped", group_ranks=missing, wait_s=PEER_WAIT_S)
        else:
            self.peers = {}
        with self._lock:
            self._pushed.clear()
            self._seen.clear()
        ranks = [w.global_rank for w in group.workers]
        world_size = group.workers[0].world_size if group.workers else 0
        self._fill(ranks, world_size)

    def _fill(self, ranks: list[int], world_size: int) -> None:
        """Give every local rank without a snapshot the newest ``_KEEP`` ones this node holds
        as replicas, or else the other agents hold."""
        for r in ranks:
            if any(s.world_size == world_size for s in list_snapshots(rank_dir(self.local, r))):
                continue
            t0 = time.monotonic()
            got = self._collect(r, world_size)
            for _, meta, data in reversed(got):
                _write_snapshot(rank_dir(self.local, r), meta, data)
            if got:
                self.events.emit(
                    "checkpoint_memory_filled",
                    rank=r,
                    steps=[m["step"] for _, m, _ in got],
                    step=got[0][1]["step"],
                    source=got[0][0],
                    snapshot_source=got[0][1].get("source"),
                    bytes=sum(len(d) for _, _, d in got),
                    duration_s=round(time.monotonic() - t0, 4),
                )

    def _collect(self, rank: int, world_size: int) -> list[tuple[str, dict[str, Any], Any]]:
        out: list[tuple[str, dict[str, Any], Any]] = []
        below: int | None = None
        while len(out) < _KEEP:
            found = self.find(rank, world_size, below=below)
            if found is not None:
                out.append(("replica", dict(found[0].meta), found[1]))
                below = found[0].step
                continue
            fetched = None
            for peer in self.peers.values():
                try:
                    fetched = fetch_snapshot(
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

    def _replicate_loop(self) -> None:
        while not self._stop.wait(0.01):
            if not self.peers:
                continue
            ring = sorted(self.peers)  # the next peer after this node, wrapping around
            target_rank = next((r for r in ring if r > self.group_rank), ring[0])
            peer = self.peers.get(target_rank)
            if peer is None:
                continue
            try:
                names = os.listdir(self.local)
            except OSError:
                continue
            for name in names:
                if not name.startswith("rank_"):
                    continue
                stamp = _dir_stamp(self.local / name)
                if stamp is None or self._seen.get(name) == stamp:
                    continue  # nothing new: skip parsing the metadata
                self._seen[name] = stamp
                snaps = list_snapshots(self.local / name)
                if not snaps or snaps[0].source.startswith("peer"):
                    continue
                snap = snaps[0]
                if self._pushed.get(snap.rank) == snap.gen:
                    continue
                data = _read_snapshot(snap)
                if data is None:
                    self._seen.pop(name, None)  # changed while read: look again
                    continue
                try:
                    push_snapshot((peer["host"], peer["port"]), snap, data, node=self.node)
                    self._pushed[snap.rank] = snap.gen
                except OSError as e:
                    self._seen.pop(name, None)
                    logger.debug("replicating rank %s to %s failed: %s", snap.rank, peer, e)

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)
        if os.environ.get(MEMORY_DIR_ENV) == str(self.local):
            del os.environ[MEMORY_DIR_ENV]


def _dir_stamp(d: Path) -> tuple[tuple[str, int], ...] | None:
    """(name, mtime) of the snapshot metadata files: changes whenever a snapshot is published."""
    try:
        return tuple(
            sorted(
                (e.name, e.stat().st_mtime_ns) for e in os.scandir(d) if e.name.endswith(".json")
            )
        )
    except OSError:
        return None


def _host_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _remove_orphans(root: Path) -> None:
    """Remove memory tiers left by agents that were killed (their pid is gone)."""
    for p in root.glob("trainguard-ckpt-*-*"):
        try:
            pid = int(p.name.split("-")[2])
            os.kill(pid, 0)
        except (ValueError, IndexError):
            continue
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:
            continue
