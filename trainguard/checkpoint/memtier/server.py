"""The memory tier's TCP server: answers the other agents' ``put`` and ``get`` requests
(:mod:`.wire`) from a :class:`~.store.TierStore`."""

from __future__ import annotations

import logging
import socketserver
import threading

from trainguard.checkpoint.memtier.store import TierStore
from trainguard.checkpoint.memtier.wire import recv_message, send_message

__all__ = ["TierServer"]

logger = logging.getLogger(__name__)


class _Handler(socketserver.BaseRequestHandler):
    server: TierServer

    def handle(self) -> None:
        store = self.server.store
        try:
            header, payload = recv_message(self.request)
            if header["op"] == "put":
                meta = dict(header["meta"])
                meta["source"] = f"peer:{header.get('node', '?')}"
                store.store_replica(meta, payload)
                send_message(self.request, {"ok": True})
            elif header["op"] == "get":
                found = store.find(
                    int(header["rank"]), int(header["world_size"]), below=header.get("below")
                )
                if found is None:
                    send_message(self.request, {"found": False})
                else:
                    snap, data = found
                    send_message(
                        self.request, {"found": True, "meta": snap.meta, "nbytes": len(data)}, data
                    )
        except (OSError, ValueError, KeyError) as e:
            logger.warning("memory tier request from %s failed: %s", self.client_address, e)


class TierServer(socketserver.ThreadingTCPServer):
    """Serves ``store`` on ``addr`` from a daemon thread once :meth:`start` is called."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], store: TierStore) -> None:
        self.store = store
        super().__init__(addr, _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> None:
        threading.Thread(target=self.serve_forever, name="tg-memtier-server", daemon=True).start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
