"""The memory tier's TCP server: answers the other agents' ``put`` and ``get`` requests
(:mod:`.wire`) from a :class:`~.store.TierStore`, to clients that know the job's secret."""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from collections import Counter, OrderedDict
from typing import TypeGuard

from trainguard.checkpoint.memtier.store import TierStore
from trainguard.checkpoint.memtier.wire import (
    MAX_HEADER,
    AuthError,
    Channel,
    ProtocolError,
    validate_meta,
)
from trainguard.checkpoint.staging import outgoing_meta

__all__ = ["TierServer"]

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 16
"""Authenticated requests served at once; more are refused (each holds a thread)."""
MAX_PENDING = 64
"""Connections not yet authenticated held at once; a new one beyond it evicts the oldest."""
MAX_PENDING_PER_SOURCE = 8
"""Connections not yet authenticated held at once from one address; a new one beyond it evicts
that address's oldest, so one host cannot fill :data:`MAX_PENDING`."""
AUTH_TIMEOUT_S = 2.0
"""A new connection must authenticate (a fixed-size answer to the challenge, then its first
frame) within this many seconds; only then may it take one of the :data:`MAX_CONNECTIONS`
slots. Together with oldest-first eviction, connections without the secret (idle, slow, or
reconnecting in a loop) cannot keep the job's own fetches out: a peer that knows the secret
answers in one round trip, long before it is the oldest pending connection."""


class _Handler(socketserver.BaseRequestHandler):
    server: TierServer

    def handle(self) -> None:
        srv = self.server
        secret = srv.secret
        if secret is None:
            srv.count("refused_no_secret")
            return  # no job secret yet (before the first rendezvous)
        srv._enter_pending(self.request, self.client_address[0])
        ch: Channel | None = None
        slot = False
        try:
            try:
                self.request.settimeout(srv.auth_timeout_s)
                ch = Channel(
                    self.request,
                    secret,
                    server=True,
                    max_header=srv.max_header,
                    deadline=time.monotonic() + srv.auth_timeout_s,
                )
                header = ch.recv()  # verified: the peer knows the secret
            finally:
                srv._leave_pending(self.request)
            if not srv._slots.acquire(blocking=False):
                srv.count("refused_busy")
                self._try_send(ch, {"ok": False, "error": "server busy"})
                return
            slot = True
            ch.deadline = time.monotonic() + srv.request_timeout_s
            op = header.get("op")
            if op == "put":
                self._put(ch, header)
            elif op == "get":
                self._get(ch, header)
            else:
                raise ProtocolError(f"unknown op {op!r}")
        except AuthError as e:
            srv.count("refused_auth")
            logger.warning("memory tier: refused %s: %s", self.client_address[0], e)
        except ProtocolError as e:
            srv.count("refused_invalid")
            logger.warning("memory tier: refused %s: %s", self.client_address[0], e)
            self._try_send(ch, {"ok": False, "error": str(e)})
        except (OSError, ValueError, KeyError) as e:
            srv.count("failed" if slot else "refused_unauthenticated")
            if slot:
                logger.warning("memory tier request from %s failed: %s", self.client_address[0], e)
        finally:
            if slot:
                srv._slots.release()

    @staticmethod
    def _try_send(ch: Channel | None, msg: dict) -> None:
        if ch is None:
            return
        try:
            ch.send(msg)
        except OSError:
            pass

    def _put(self, ch: Channel, header: dict) -> None:
        srv = self.server
        meta = validate_meta(header.get("meta"), max_bytes=srv.max_bytes)
        node = header.get("node")
        if not isinstance(node, str) or len(node) > 256:
            raise ProtocolError("node: expected a short string")
        entitled, world_size = srv.entitled
        if meta["rank"] not in entitled or meta["world_size"] != world_size:
            srv.count("refused_not_entitled")
            raise ProtocolError(
                f"rank {meta['rank']} of world size {meta['world_size']}: this node does not "
                f"replicate it (ranks {sorted(entitled)[:8]} of world size {world_size})"
            )
        nbytes = meta["nbytes"]
        if not srv.reserve(nbytes):
            srv.count("refused_space")
            ch.send({"ok": False, "error": f"no space for {nbytes} bytes"})
            return
        try:
            meta = dict(meta)
            meta["source"] = f"peer:{node}"
            ch.send({"ok": True})
            tmp = srv.store.incoming()
            if not ch.recv_file(tmp, nbytes):
                ch.send({"ok": False, "error": "snapshot changed while sent"})
                return
            try:
                srv.store.place("replica", meta, tmp)
            finally:
                tmp.unlink(missing_ok=True)
        finally:
            srv.release(nbytes)
        srv.count("put")
        ch.send({"ok": True})

    def _get(self, ch: Channel, header: dict) -> None:
        rank, ws, below = header.get("rank"), header.get("world_size"), header.get("below")
        if not (_count(rank) and _count(ws) and (below is None or _count(below))):
            raise ProtocolError(f"get: {header!r}: rank, world_size, below must be ints >= 0")
        snap = self.server.store.find_snapshot(rank, ws, below=below)
        if snap is None:
            ch.send({"found": False})
            return
        nbytes = int(snap.meta["nbytes"])
        ch.send({"found": True, "meta": outgoing_meta(snap), "nbytes": nbytes})
        ch.send_file(snap.bin_path, nbytes, snap.still_valid)
        self.server.count("get")


class TierServer(socketserver.ThreadingTCPServer):
    """Serves ``store`` on ``addr`` from a daemon thread once :meth:`start` is called; refuses
    every connection until :meth:`set_secret`. ``counts`` tells what it did (``put``, ``get``,
    ``refused_auth``, ``refused_invalid``, ``refused_space`` ...)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        addr: tuple[str, int],
        store: TierStore,
        *,
        secret: bytes | None = None,
        max_header: int = MAX_HEADER,
        max_bytes: int = 1 << 62,
        request_timeout_s: float = 600.0,
        auth_timeout_s: float = AUTH_TIMEOUT_S,
    ) -> None:
        self.store = store
        self.secret = secret
        self.max_header = max_header
        self.max_bytes = max_bytes
        self.request_timeout_s = request_timeout_s
        self.auth_timeout_s = auth_timeout_s
        self.counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._reserved = 0
        self.entitled: tuple[frozenset[int], int] = (frozenset(), 0)
        """Ranks and world size a peer may push (:meth:`set_entitled`); none before that."""
        self._pending: OrderedDict[socket.socket, str] = OrderedDict()
        self.max_pending = MAX_PENDING
        self.max_pending_per_source = MAX_PENDING_PER_SOURCE
        super().__init__(addr, _Handler)

    def _enter_pending(self, sock: socket.socket, source: str) -> None:
        """Hold ``sock`` as not yet authenticated; evict the oldest pending connection of
        ``source`` when it has :attr:`max_pending_per_source`, else the oldest of all when
        there are :attr:`max_pending` (its handler's read ends at once)."""
        with self._counts_lock:
            same = [s for s, src in self._pending.items() if src == source]
            victim = None
            if len(same) >= self.max_pending_per_source:
                victim = same[0]
            elif len(self._pending) >= self.max_pending:
                victim = next(iter(self._pending))
            if victim is not None:
                del self._pending[victim]
                self.counts["evicted_pending"] += 1
            self._pending[sock] = source
        if victim is not None:
            try:
                victim.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _leave_pending(self, sock: socket.socket) -> None:
        with self._counts_lock:
            self._pending.pop(sock, None)

    @property
    def host(self) -> str:
        return str(self.server_address[0])

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def set_secret(self, secret: bytes) -> None:
        self.secret = secret

    def set_entitled(self, ranks: set[int], world_size: int) -> None:
        """Accept pushes of these ``ranks`` of ``world_size`` only (the previous node's)."""
        self.entitled = (frozenset(ranks), world_size)

    def reserve(self, nbytes: int) -> bool:
        """Book ``nbytes`` of the tier's free space for a transfer (concurrent transfers never
        count the same free bytes twice); False if they are not there. :meth:`release` after."""
        with self._counts_lock:
            if nbytes > self.store.free_bytes() - self._reserved:
                return False
            self._reserved += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._counts_lock:
            self._reserved -= nbytes

    def count(self, what: str) -> None:
        with self._counts_lock:
            self.counts[what] += 1

    def start(self) -> None:
        threading.Thread(target=self.serve_forever, name="tg-memtier-server", daemon=True).start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def _count(v: object) -> TypeGuard[int]:
    """An int >= 0 (not a bool)."""
    return type(v) is int and v >= 0
