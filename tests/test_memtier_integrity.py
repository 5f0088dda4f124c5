"""The memory tier against a hostile network and hostile clients: real TierServers on loopback,
real sockets. A bit flipped on the way is refused; slow connections without the secret do not
keep the job's own fetches out; a peer may only push the ranks it replicates."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
import uuid
from pathlib import Path

import pytest

from trainguard.checkpoint import jsoncodec
from trainguard.checkpoint.memtier import wire
from trainguard.checkpoint.memtier.server import MAX_CONNECTIONS, TierServer
from trainguard.checkpoint.memtier.store import TierStore, write_snapshot
from trainguard.checkpoint.memtier.wire import (
    MAGIC,
    NONCE_LEN,
    Channel,
    ProtocolError,
    fetch_snapshot,
    push_snapshot,
)
from trainguard.checkpoint.staging import list_snapshots, rank_dir

SECRET = b"k" * 32


def _meta(step: int, nbytes: int, *, rank: int = 0, world_size: int = 2) -> dict:
    return {
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "gen": uuid.uuid4().hex,
        "time": time.time(),
        "nbytes": nbytes,
        "entries": [["float32", [nbytes // 4], 0, nbytes]],
        "skeleton": jsoncodec.dumps({"w": None}),
        "source": "memory",
    }


def _tree(root: Path) -> list[tuple[str, int]]:
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")
    )


class FlipProxy:
    """A TCP proxy on loopback that flips one bit of the snapshot bytes going one way:
    ``"down"`` (server → client: a fetch) or ``"up"`` (client → server: a push)."""

    def __init__(self, upstream: tuple[str, int], direction: str, *, at: int = 100) -> None:
        self.upstream = upstream
        self.direction = direction
        self.at = at
        self.flipped = 0
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self._threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            u = socket.create_connection(self.upstream)
            for src, dst, way in ((c, u, "up"), (u, c, "down")):
                t = threading.Thread(target=self._pump, args=(src, dst, way), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        # the payload starts after the challenge (down), the client's nonce and proof (up),
        # and the first frame of that way
        buf = bytearray()
        skip = len(MAGIC) + NONCE_LEN if way == "down" else NONCE_LEN + wire.MAC_LEN
        target: int | None = None
        pos = 0
        try:
            while data := src.recv(65536):
                data = bytearray(data)
                if way == self.direction:
                    buf += data
                    if target is None and len(buf) >= skip + 4:
                        (n,) = struct.unpack(">I", buf[skip : skip + 4])
                        target = skip + 4 + n + 32 + self.at
                    if target is not None and pos <= target < pos + len(data):
                        data[target - pos] ^= 0x01
                        self.flipped += 1
                pos += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.lsock.close()


@pytest.fixture
def served(tmp_path: Path):
    (tmp_path / "srv").mkdir()
    store = TierStore(tmp_path / "srv")
    srv = TierServer(("127.0.0.1", 0), store, secret=SECRET, auth_timeout_s=2.0)
    srv.set_entitled({0, 1}, 2)
    srv.start()
    try:
        yield srv, store
    finally:
        srv.stop()


@pytest.fixture
def sender(tmp_path: Path) -> TierStore:
    (tmp_path / "send").mkdir()
    return TierStore(tmp_path / "send")


@pytest.fixture(params=["one segment", "many segments"])
def segments(request, monkeypatch: pytest.MonkeyPatch) -> int:
    """The payload MAC over one segment, or over 4 KiB segments hashed by several threads."""
    if request.param == "many segments":
        monkeypatch.setattr(wire, "SEGMENT", 4096)
    return wire.SEGMENT


def test_a_bit_flipped_in_a_fetched_snapshot_is_refused(served, tmp_path: Path, segments) -> None:
    srv, store = served
    payload = os.urandom(65536)
    write_snapshot(rank_dir(store.local, 0), _meta(5, 65536), payload)
    proxy = FlipProxy(("127.0.0.1", srv.port), "down", at=50_000)
    try:
        dest = tmp_path / "got.bin"
        with pytest.raises(ProtocolError, match="MAC"):
            fetch_snapshot(
                ("127.0.0.1", proxy.port),
                secret=SECRET,
                rank=0,
                world_size=2,
                dest=dest,
                max_bytes=1 << 20,
            )
        assert proxy.flipped == 1
        assert not dest.exists()
        # the same fetch without the proxy gets the bytes as they are
        meta = fetch_snapshot(
            ("127.0.0.1", srv.port),
            secret=SECRET,
            rank=0,
            world_size=2,
            dest=dest,
            max_bytes=1 << 20,
        )
        assert meta is not None and dest.read_bytes() == payload
    finally:
        proxy.close()


def test_a_bit_flipped_in_a_pushed_snapshot_is_refused(served, sender, segments) -> None:
    srv, store = served
    write_snapshot(rank_dir(sender.local, 0), _meta(6, 65536), os.urandom(65536))
    snap = list_snapshots(rank_dir(sender.local, 0))[0]
    before = _tree(store.root)
    proxy = FlipProxy(("127.0.0.1", srv.port), "up", at=30_000)
    try:
        with pytest.raises((ProtocolError, OSError)):
            push_snapshot(("127.0.0.1", proxy.port), snap, secret=SECRET, node="n1")
        assert proxy.flipped == 1
        deadline = time.monotonic() + 10
        while srv.counts["refused_invalid"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert _tree(store.root) == before  # nothing kept, no temporary file left
    finally:
        proxy.close()


def test_slow_unauthenticated_connections_do_not_starve_fetches(served, tmp_path: Path) -> None:
    """More slow connections without the secret than there are request slots: a fetch with
    the secret is served at once, and the slow ones are closed after the auth deadline."""
    srv, store = served
    payload = os.urandom(4096)
    write_snapshot(rank_dir(store.local, 1), _meta(9, 4096, rank=1), payload)
    slow = []
    try:
        for _ in range(MAX_CONNECTIONS + 8):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(b"\x00")  # a frame length begun, never finished
            slow.append(s)
        time.sleep(0.3)  # every slow one has been accepted and is waiting in the server
        dest = tmp_path / "got.bin"
        meta = fetch_snapshot(
            ("127.0.0.1", srv.port),
            secret=SECRET,
            rank=1,
            world_size=2,
            dest=dest,
            max_bytes=1 << 20,
            deadline=time.monotonic() + 10,
        )
        assert meta is not None and meta["step"] == 9 and dest.read_bytes() == payload
        for s in slow:  # the server closed them at its auth deadline (2 s here)
            s.settimeout(15)
            got = s.recv(4096)
            assert got[: len(MAGIC)] == MAGIC
            rest = got[len(MAGIC) + NONCE_LEN :]
            while chunk := s.recv(4096):
                rest += chunk
            assert rest == b""
        deadline = time.monotonic() + 10
        while srv.counts["refused_unauthenticated"] < len(slow):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        for s in slow:
            s.close()


def _push(srv: TierServer, sender: TierStore, *, rank: int, world_size: int = 2, step: int = 1):
    write_snapshot(
        rank_dir(sender.local, rank),
        _meta(step, 4096, rank=rank, world_size=world_size),
        os.urandom(4096),
    )
    snap = [s for s in list_snapshots(rank_dir(sender.local, rank)) if s.step == step][0]
    push_snapshot(("127.0.0.1", srv.port), snap, secret=SECRET, node="n1")


def test_a_peer_may_push_only_the_ranks_it_replicates(served, sender) -> None:
    srv, store = served
    srv.set_entitled({2, 3}, 4)  # the previous node runs ranks 2 and 3 of 4
    _push(srv, sender, rank=2, world_size=4)
    before = _tree(store.root)
    for rank, ws in ((0, 4), (1, 4), (2, 8)):
        with pytest.raises(ProtocolError, match="does not replicate"):
            _push(srv, sender, rank=rank, world_size=ws, step=2)
    assert srv.counts["refused_not_entitled"] == 3
    assert _tree(store.root) == before
    assert [s.step for s in list_snapshots(rank_dir(store.replica, 2))] == [1]


def test_replicas_of_ranks_no_longer_replicated_are_pruned(tmp_path: Path) -> None:
    store = TierStore(tmp_path)
    for rank in range(6):
        for step in (1, 2, 3, 4):  # more steps than slots: the newest KEEP stay
            write_snapshot(
                rank_dir(store.replica, rank), _meta(step, 64, rank=rank, world_size=8), b"x" * 64
            )
    write_snapshot(rank_dir(store.replica, 1), _meta(9, 64, rank=1, world_size=4), b"y" * 64)
    assert store.prune_replicas({0, 1}, 8) == [2, 3, 4, 5]
    assert sorted(p.name for p in store.replica.iterdir()) == ["rank_0", "rank_1"]
    # rank 1's world-size-4 snapshot took the slot of its step 2, and is gone now
    for rank, steps in ((0, [4, 3, 2]), (1, [4, 3])):
        snaps = list_snapshots(rank_dir(store.replica, rank))
        assert [s.step for s in snaps] == steps and {s.world_size for s in snaps} == {8}
        assert len(list(rank_dir(store.replica, rank).iterdir())) == 2 * len(steps)


def test_free_space_is_booked_per_transfer(served, sender) -> None:
    """Two pushes that fit one at a time but not together: the second is refused while the
    first holds its booking, not both accepted to fail on a full tier."""
    srv, store = served
    store.free_bytes = lambda: 1 << 20  # type: ignore[method-assign]  # a 1 MiB tier
    n = 600_000
    write_snapshot(rank_dir(sender.local, 0), _meta(1, n), os.urandom(n))
    write_snapshot(rank_dir(sender.local, 1), _meta(1, n, rank=1), os.urandom(n))
    a = list_snapshots(rank_dir(sender.local, 0))[0]
    b = list_snapshots(rank_dir(sender.local, 1))[0]
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    try:
        ch = Channel(sock, SECRET, server=False)
        ch.send({"op": "put", "node": "n1", "meta": a.meta, "nbytes": n})
        assert ch.recv() == {"ok": True}  # A has its go and has not sent its bytes yet
        with pytest.raises(ProtocolError, match="no space"):
            push_snapshot(("127.0.0.1", srv.port), b, secret=SECRET, node="n1")
        ch.send_file(a.bin_path, n, a.still_valid)
        assert ch.recv() == {"ok": True}
    finally:
        sock.close()
    assert [s.step for s in list_snapshots(rank_dir(store.replica, 0))] == [1]
    assert list_snapshots(rank_dir(store.replica, 1)) == []
    push_snapshot(("127.0.0.1", srv.port), b, secret=SECRET, node="n1")  # booking released


def test_zero_snapshot_bound_is_refused() -> None:
    from trainguard.core.config.checkpoint import CheckpointConfig

    with pytest.raises(ValueError, match="peer_max_snapshot_bytes must be > 0"):
        CheckpointConfig(peer_max_snapshot_bytes=0)
    assert CheckpointConfig(peer_max_snapshot_bytes=None).peer_max_snapshot_bytes is None
