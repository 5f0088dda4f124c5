"""The memory tier's wire protocol between agents: authenticated, bounded, streamed.

Every connection starts with the server's challenge, ``MAGIC`` + a random 32-byte nonce, and
the client's answer, a random 32-byte nonce of its own and ``HMAC-SHA256(secret, b"auth" ||
server nonce || client nonce)``: fixed sizes, so the server reads nothing larger and allocates
nothing before the client has proved it knows the secret. The connection's ``nonce`` is both
(server's || client's): every MAC after that covers both, so neither side can be answered with
frames recorded from another connection (a recorded answer fails the client's fresh nonce,
also when the secret stays the same across attempts, as with ``memory_secret_file``). Every
message after it (both ways) is a *frame*: a 4-byte big-endian length (at most the receiver's
``max_header``), a JSON header, and ``HMAC-SHA256(secret, direction || nonce || seq || header)``
(``direction`` is ``b"req"`` or ``b"resp"``, ``seq`` the frame's 8-byte number in that
direction, so a frame cannot be replayed or reordered within the connection either). The secret
is the job's (see :mod:`.plugin`); an answer or a frame whose MAC does not verify ends the
connection before anything is read from or written to the tier.

Requests:

- ``{"op": "put", "node", "meta", "nbytes"}``: the server validates ``meta`` (:func:`validate_meta`)
  and checks the space, answers ``{"ok": true}`` (go) or ``{"ok": false, "error"}``; after a go
  the client streams the snapshot's ``nbytes`` bytes and a trailer frame ``{"intact", "mac"}``
  (``intact``: the file did not change while sent; ``mac``: the bytes' MAC, :class:`FileMac`,
  keyed with the secret and bound to the connection's nonce), and the server answers ``{"ok": true}`` once the replica is in place.
- ``{"op": "get", "rank", "world_size", "below"}``: answered ``{"found": false}`` or
  ``{"found": true, "meta", "nbytes"}`` + the bytes + the trailer frame; the client refuses a
  snapshot of another rank or world size, or of a step not below the ``below`` it asked for.

The metadata travels in an authenticated frame, the bytes under the trailer's MAC, the trailer
in an authenticated frame: a bit changed on the way anywhere is refused. A receiver writes the
bytes into a temporary file of the tier in bounded chunks and renames it into a snapshot slot
only when it is complete, its MAC verifies and the trailer says it is intact, so a refused,
altered or broken transfer leaves nothing behind. Payloads are not encrypted: the tier's network must be
the job's own (as for NCCL and the rendezvous store).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import socket
import struct
import time
from pathlib import Path
from typing import Any

from trainguard.checkpoint.jsoncodec import DTYPE_SIZES
from trainguard.checkpoint.staging import Snapshot, decode_skeleton, outgoing_meta

__all__ = [
    "MAX_HEADER",
    "TIMEOUT_S",
    "AuthError",
    "Channel",
    "ProtocolError",
    "FileMac",
    "fetch_snapshot",
    "push_snapshot",
    "validate_meta",
]

TIMEOUT_S = 30.0
"""Connect and socket timeout of the client side (and of each server-side read)."""
MAX_HEADER = 4 << 20
"""Largest header (JSON: the snapshot's metadata, its skeleton included) a side accepts."""
MAGIC = b"TGM3"
NONCE_LEN = 32
MAC_LEN = 32
CHUNK = 1 << 20
"""Receive buffer: a transfer never holds more than this of a snapshot in memory."""
MAX_DIMS = 64


class ProtocolError(ValueError):
    """The peer sent something this side does not accept (size, field, dtype)."""


class AuthError(ProtocolError):
    """The peer does not know the job's secret."""


def _mac(secret: bytes, direction: bytes, nonce: bytes, seq: int, header: bytes) -> bytes:
    return hmac.new(
        secret, direction + nonce + seq.to_bytes(8, "big") + header, hashlib.sha256
    ).digest()


def _auth_mac(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"auth" + server_nonce + client_nonce, hashlib.sha256).digest()


SEGMENT = 32 << 20
"""The payload MAC is a tree: one HMAC per segment of this size, hashed on several cores while
the bytes are on the wire, and one HMAC over those."""
MAC_THREADS = max(1, min(4, os.cpu_count() or 1))


class FileMac:
    """``HMAC-SHA256(secret, b"data" || nonce || nbytes || leaf_0 || leaf_1 ...)`` with
    ``leaf_i = HMAC-SHA256(secret, b"seg" || nonce || i || segment i)`` over the first
    ``nbytes`` of the open file ``fd``; :meth:`ready` hands a segment to the hashing threads
    once its bytes are in the file. One HMAC-SHA256 pass over the bytes (OpenSSL's, with the
    CPU's SHA instructions where it has them), spread over up to :data:`MAC_THREADS` cores and
    overlapped with the transfer."""

    def __init__(self, secret: bytes, nonce: bytes, fd: int, nbytes: int) -> None:
        self.secret, self.nonce, self.fd, self.nbytes = secret, nonce, fd, nbytes
        self.segments = max(1, -(-nbytes // SEGMENT))
        self._pool: Any = None
        self._leaves: list[Any] = []
        if self.segments > 1:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(min(MAC_THREADS, self.segments), "tg-memtier-mac")

    def _leaf(self, i: int) -> bytes:
        h = hmac.new(self.secret, b"seg" + self.nonce + i.to_bytes(8, "big"), hashlib.sha256)
        off, end = i * SEGMENT, min((i + 1) * SEGMENT, self.nbytes)
        while off < end:
            data = os.pread(self.fd, min(CHUNK * 4, end - off), off)
            if not data:
                raise ConnectionError(f"file ended at {off} of {self.nbytes} bytes")
            h.update(data)
            off += len(data)
        return h.digest()

    def ready(self, i: int) -> None:
        """Segment ``i`` is complete in the file (call in order, once each)."""
        if self._pool is not None:
            self._leaves.append(self._pool.submit(self._leaf, i))

    def bytes_ready(self, done: int) -> None:
        """The first ``done`` bytes are in the file: hand over the segments they complete."""
        while len(self._leaves) < self.segments - 1 and done >= (len(self._leaves) + 1) * SEGMENT:
            self.ready(len(self._leaves))

    def hexdigest(self) -> str:
        if self._pool is None:
            leaves = [self._leaf(0)]
        else:
            self.bytes_ready(self.nbytes)
            if len(self._leaves) < self.segments:
                self.ready(self.segments - 1)
            leaves = [f.result() for f in self._leaves]
        head = b"data" + self.nonce + self.nbytes.to_bytes(8, "big")
        return hmac.new(self.secret, head + b"".join(leaves), hashlib.sha256).hexdigest()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        _apply_deadline(sock, deadline)
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


def _apply_deadline(sock: socket.socket, deadline: float | None) -> None:
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("memory tier transfer ran past its deadline")
    sock.settimeout(min(left, TIMEOUT_S))


class Channel:
    """One authenticated connection: ``server=True`` sends the challenge, else reads it."""

    def __init__(
        self,
        sock: socket.socket,
        secret: bytes,
        *,
        server: bool,
        max_header: int = MAX_HEADER,
        deadline: float | None = None,
    ) -> None:
        self.sock = sock
        self.secret = secret
        self.max_header = max_header
        self.deadline = deadline
        self._tx, self._rx = (b"resp", b"req") if server else (b"req", b"resp")
        self._tx_seq = 0
        self._rx_seq = 0
        if server:
            mine = secrets.token_bytes(NONCE_LEN)
            sock.sendall(MAGIC + mine)
            answer = bytes(recv_exact(sock, NONCE_LEN + MAC_LEN, deadline))
            theirs, proof = answer[:NONCE_LEN], answer[NONCE_LEN:]
            if not hmac.compare_digest(proof, _auth_mac(secret, mine, theirs)):
                raise AuthError("peer failed authentication (no or wrong job secret)")
            self.nonce = mine + theirs
        else:
            hello = recv_exact(sock, len(MAGIC) + NONCE_LEN, deadline)
            if bytes(hello[: len(MAGIC)]) != MAGIC:
                raise ProtocolError("not a trainguard memory tier server (or another version)")
            server_nonce = bytes(hello[len(MAGIC) :])
            mine = secrets.token_bytes(NONCE_LEN)
            sock.sendall(mine + _auth_mac(secret, server_nonce, mine))
            self.nonce = server_nonce + mine

    def send(self, header: dict[str, Any]) -> None:
        h = json.dumps(header).encode()
        mac = _mac(self.secret, self._tx, self.nonce, self._tx_seq, h)
        self._tx_seq += 1
        self.sock.sendall(struct.pack(">I", len(h)) + h + mac)

    def recv(self) -> dict[str, Any]:
        (n,) = struct.unpack(">I", recv_exact(self.sock, 4, self.deadline))
        if n > self.max_header:
            raise ProtocolError(f"header of {n} bytes (limit {self.max_header})")
        h = bytes(recv_exact(self.sock, n, self.deadline))
        mac = bytes(recv_exact(self.sock, MAC_LEN, self.deadline))
        if not hmac.compare_digest(mac, _mac(self.secret, self._rx, self.nonce, self._rx_seq, h)):
            raise AuthError("peer failed authentication (no or wrong job secret)")
        self._rx_seq += 1
        try:
            header = json.loads(h)
        except ValueError as e:
            raise ProtocolError(f"header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise ProtocolError("header is not a JSON object")
        return header

    def send_file(self, path: Path, nbytes: int, still_valid: Any) -> None:
        """Stream ``nbytes`` of ``path`` (kernel ``sendfile``) while its MAC is computed, then
        the trailer frame (``intact``: ``still_valid()`` after the last byte; the MAC)."""
        with open(path, "rb") as f:
            mac = FileMac(self.secret, self.nonce, f.fileno(), nbytes)
            try:
                mac.bytes_ready(nbytes)  # the whole file is there: hash while it is sent
                sent = self.sock.sendfile(f, 0, nbytes) if nbytes else 0
                if sent != nbytes:
                    raise ConnectionError(f"{path}: sent {sent} of {nbytes} bytes")
                digest = mac.hexdigest()
            finally:
                mac.close()
        self.send({"intact": bool(still_valid()), "mac": digest})

    def recv_file(self, dest: Path, nbytes: int) -> bool:
        """Write ``nbytes`` from the peer into a new file ``dest`` in bounded chunks (hashing
        each complete segment meanwhile); True if the trailer says the sender's file was
        intact. Raises :class:`ProtocolError` if the bytes do not match the trailer's MAC.
        ``dest`` is removed on any failure."""
        buf = bytearray(min(CHUNK, max(nbytes, 1)))
        view = memoryview(buf)
        ok = False
        try:
            fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "r+b", buffering=0) as f:
                mac = FileMac(self.secret, self.nonce, f.fileno(), nbytes)
                try:
                    done = 0
                    while done < nbytes:
                        _apply_deadline(self.sock, self.deadline)
                        k = self.sock.recv_into(view[: min(nbytes - done, len(buf))])
                        if not k:
                            raise ConnectionError("peer closed the connection mid-transfer")
                        f.write(view[:k])
                        done += k
                        mac.bytes_ready(done)
                    trailer = self.recv()
                    digest = mac.hexdigest()
                finally:
                    mac.close()
            got = trailer.get("mac")
            if not isinstance(got, str) or not hmac.compare_digest(got, digest):
                raise ProtocolError("snapshot bytes do not match their MAC (altered on the way)")
            ok = trailer.get("intact") is True
            return ok
        finally:
            if not ok:
                dest.unlink(missing_ok=True)


def _int(v: Any, name: str, lo: int = 0, hi: int | None = None) -> int:
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        raise ProtocolError(f"{name}={v!r}: expected an integer in [{lo}, {hi}]")
    return v


def validate_meta(meta: Any, *, max_bytes: int) -> dict[str, Any]:
    """``meta`` if it is a well-formed snapshot metadata of at most ``max_bytes`` bytes whose
    tensors all have allowed dtypes and lie inside the snapshot; else :class:`ProtocolError`."""
    if not isinstance(meta, dict):
        raise ProtocolError("meta is not an object")
    _int(meta.get("step"), "step")
    ws = _int(meta.get("world_size"), "world_size", 1, 1 << 24)
    _int(meta.get("rank"), "rank", 0, ws - 1)
    nbytes = _int(meta.get("nbytes"), "nbytes", 0, max_bytes)
    gen = meta.get("gen")
    if not isinstance(gen, str) or not (0 < len(gen) <= 64) or not gen.isalnum():
        raise ProtocolError(f"gen={gen!r}: expected a short alphanumeric string")
    if not isinstance(meta.get("time"), int | float) or not math.isfinite(meta["time"]):
        raise ProtocolError("time: expected a number")
    for k in ("skeleton", "source", "digest"):
        if k in meta and not isinstance(meta[k], str):
            raise ProtocolError(f"{k}: expected a string")
    entries = meta.get("entries")
    if not isinstance(entries, list):
        raise ProtocolError("entries: expected a list")
    for e in entries:
        if not (isinstance(e, list) and len(e) == 4):
            raise ProtocolError(f"entry {e!r}: expected [dtype, shape, offset, nbytes]")
        dtype, shape, off, n = e
        if dtype not in DTYPE_SIZES:
            raise ProtocolError(f"dtype {dtype!r} is not allowed")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise ProtocolError(f"shape {shape!r}: expected a list of sizes")
        numel = math.prod(_int(d, "shape", 0, nbytes) for d in shape)
        _int(off, "offset", 0, nbytes)
        _int(n, "entry nbytes", 0, nbytes - off)
        if n != numel * DTYPE_SIZES[dtype]:
            raise ProtocolError(f"entry {e!r}: {n} bytes do not match its shape and dtype")
    if "skeleton" in meta:
        try:
            decode_skeleton(meta["skeleton"], len(entries))
        except ValueError as e:
            raise ProtocolError(str(e)) from None
    return meta


def _connect(addr: tuple[str, int], secret: bytes, deadline: float | None) -> Channel:
    timeout = (
        TIMEOUT_S if deadline is None else max(0.001, min(TIMEOUT_S, deadline - time.monotonic()))
    )
    sock = socket.create_connection(addr, timeout=timeout)
    try:
        return Channel(sock, secret, server=False, deadline=deadline)
    except BaseException:
        sock.close()
        raise


def push_snapshot(
    addr: tuple[str, int],
    snap: Snapshot,
    *,
    secret: bytes,
    node: str,
    deadline: float | None = None,
) -> None:
    """Store ``snap`` as a replica on the agent at ``addr``; raises ``OSError`` or
    :class:`ProtocolError` (refused: its ``error``)."""
    nbytes = int(snap.meta["nbytes"])
    ch = _connect(addr, secret, deadline)
    with ch.sock:
        ch.send({"op": "put", "node": node, "meta": outgoing_meta(snap), "nbytes": nbytes})
        go = ch.recv()
        if not go.get("ok"):
            raise ProtocolError(f"peer refused the snapshot: {go.get('error')}")
        ch.send_file(snap.bin_path, nbytes, snap.still_valid)
        done = ch.recv()
        if not done.get("ok"):
            raise ProtocolError(f"peer did not keep the snapshot: {done.get('error')}")


def fetch_snapshot(
    addr: tuple[str, int],
    *,
    secret: bytes,
    rank: int,
    world_size: int,
    dest: Path,
    below: int | None = None,
    max_bytes: int,
    deadline: float | None = None,
) -> dict[str, Any] | None:
    """The peer's newest snapshot of ``rank`` (older than step ``below`` if given): its
    metadata, its bytes written to the new file ``dest``; None if it has none."""
    ch = _connect(addr, secret, deadline)
    with ch.sock:
        ch.send({"op": "get", "rank": rank, "world_size": world_size, "below": below})
        header = ch.recv()
        if "error" in header:
            raise ProtocolError(f"peer refused the fetch: {header.get('error')}")
        if not header.get("found"):
            return None
        meta = validate_meta(header.get("meta"), max_bytes=max_bytes)
        if meta["rank"] != rank or meta["world_size"] != world_size:
            raise ProtocolError(f"asked for rank {rank}, got rank {meta['rank']}")
        if below is not None and meta["step"] >= below:
            raise ProtocolError(f"asked for a step below {below}, got step {meta['step']}")
        if not ch.recv_file(dest, meta["nbytes"]):
            raise ProtocolError("the snapshot changed on the peer while it was sent")
    return meta
