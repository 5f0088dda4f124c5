"""The memory tier's wire protocol between agents.

A message is a 4-byte big-endian header length, a JSON header, then ``nbytes`` raw bytes.
Requests: ``{"op": "put", "node", "meta", "nbytes"}`` + the snapshot's bytes, answered
``{"ok": true}``; ``{"op": "get", "rank", "world_size", "below"}``, answered
``{"found": false}`` or ``{"found": true, "meta", "nbytes"}`` + the bytes.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from trainguard.checkpoint.staging import Snapshot

__all__ = ["TIMEOUT_S", "fetch_snapshot", "push_snapshot", "recv_message", "send_message"]

TIMEOUT_S = 30.0
"""Connect and socket timeout of the client side."""


def send_message(
    sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b""
) -> None:
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


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], bytearray]:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    header = json.loads(_recv_exact(sock, n))
    payload = _recv_exact(sock, int(header.get("nbytes", 0)))
    return header, payload


def push_snapshot(addr: tuple[str, int], snap: Snapshot, data: bytes, *, node: str) -> None:
    """Store ``snap`` (its bytes ``data``) as a replica on the agent at ``addr``."""
    with socket.create_connection(addr, timeout=TIMEOUT_S) as s:
        send_message(s, {"op": "put", "node": node, "meta": snap.meta, "nbytes": len(data)}, data)
        header, _ = recv_message(s)
        if not header.get("ok"):
            raise ConnectionError(f"peer refused snapshot: {header}")


def fetch_snapshot(
    addr: tuple[str, int], *, rank: int, world_size: int, below: int | None = None
) -> tuple[dict[str, Any], bytearray] | None:
    """The peer's newest snapshot of ``rank`` (older than step ``below`` if given)."""
    with socket.create_connection(addr, timeout=TIMEOUT_S) as s:
        send_message(s, {"op": "get", "rank": rank, "world_size": world_size, "below": below})
        header, payload = recv_message(s)
    if not header.get("found"):
        return None
    return header["meta"], payload
