"""The memory tier's peer protocol against hostile or broken peers: a real TierServer on
loopback, real sockets. Every refusal leaves the receiving tier's files exactly as they were."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint import jsoncodec
from trainguard.checkpoint.memtier.plugin import route_ip
from trainguard.checkpoint.memtier.replication import Replicator, collect
from trainguard.checkpoint.memtier.server import TierServer
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

SECRET = b"s" * 32


def _tree(root: Path) -> list[tuple[str, int]]:
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")
    )


def _meta(step: int, nbytes: int, *, rank: int = 0, dtype: str = "float32") -> dict:
    return {
        "step": step,
        "rank": rank,
        "world_size": 2,
        "gen": uuid.uuid4().hex,
        "time": time.time(),
        "nbytes": nbytes,
        "entries": [[dtype, [nbytes // 4], 0, nbytes]],
        "skeleton": jsoncodec.dumps({"w": None}),
        "source": "memory",
    }


def _local_snapshot(store: TierStore, step: int, nbytes: int = 4096):
    write_snapshot(rank_dir(store.local, 0), _meta(step, nbytes), os.urandom(nbytes))
    return list_snapshots(rank_dir(store.local, 0))[0]


@pytest.fixture
def served(tmp_path: Path):
    (tmp_path / "recv").mkdir()
    store = TierStore(tmp_path / "recv")
    srv = TierServer(("127.0.0.1", 0), store, secret=SECRET, max_header=64 << 10)
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


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_push_and_fetch_with_the_secret(served, sender, tmp_path: Path) -> None:
    srv, store = served
    snap = _local_snapshot(sender, 7)
    push_snapshot(("127.0.0.1", srv.port), snap, secret=SECRET, node="n1")
    got = list_snapshots(rank_dir(store.replica, 0))
    assert [s.step for s in got] == [7] and got[0].source == "peer:n1"
    assert got[0].bin_path.read_bytes() == snap.bin_path.read_bytes()
    dest = tmp_path / "fetched.bin"
    meta = fetch_snapshot(
        ("127.0.0.1", srv.port), secret=SECRET, rank=0, world_size=2, dest=dest, max_bytes=1 << 20
    )
    assert meta is not None and meta["step"] == 7
    assert dest.read_bytes() == snap.bin_path.read_bytes()


def test_unauthenticated_client_is_refused(served) -> None:
    srv, store = served
    before = _tree(store.root)
    payload = os.urandom(4096)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        # the protocol as it was: length, JSON header, payload, and no MAC
        h = json.dumps({"op": "put", "node": "evil", "meta": _meta(9, 4096), "nbytes": 4096})
        s.sendall(struct.pack(">I", len(h)) + h.encode() + payload)
        s.settimeout(5)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got[: len(MAGIC)] == MAGIC and len(got) == len(MAGIC) + NONCE_LEN  # challenge only
    _wait(lambda: srv.counts["refused_auth"] == 1)
    assert _tree(store.root) == before


def test_wrong_secret_is_refused_both_ways(served, sender, tmp_path: Path) -> None:
    srv, store = served
    _local_snapshot(store, 3)  # something the wrong client would like to read
    before = _tree(store.root)
    snap = _local_snapshot(sender, 9)
    with pytest.raises((OSError, ProtocolError)):
        push_snapshot(("127.0.0.1", srv.port), snap, secret=b"x" * 32, node="evil")
    with pytest.raises((OSError, ProtocolError)):
        fetch_snapshot(
            ("127.0.0.1", srv.port),
            secret=b"x" * 32,
            rank=0,
            world_size=2,
            dest=tmp_path / "stolen.bin",
            max_bytes=1 << 20,
        )
    assert not (tmp_path / "stolen.bin").exists()
    _wait(lambda: srv.counts["refused_auth"] == 2)
    assert _tree(store.root) == before


def test_oversized_header_is_refused_before_it_is_read(served) -> None:
    srv, store = served
    before = _tree(store.root)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.settimeout(5)
        ch = Channel(s, SECRET, server=False)
        s.sendall(struct.pack(">I", (1 << 31) + 5))  # 2 GiB of header announced
        assert ch.recv() == {"ok": False, "error": f"header of {(1 << 31) + 5} bytes (limit 65536)"}
    assert srv.counts["refused_invalid"] == 1
    assert _tree(store.root) == before


@pytest.mark.parametrize(
    "bad",
    [
        {"dtype": "__class__"},
        {"dtype": "Tensor"},
        {"nbytes": -1},
        {"nbytes": 1 << 70},
        {"rank": 5},
        {"step": "7"},
        {"entries": [["float32", [2048], 0, 4096]]},  # outside the snapshot
    ],
)
def test_bad_metadata_is_refused(served, sender, bad: dict) -> None:
    srv, store = served
    before = _tree(store.root)
    snap = _local_snapshot(sender, 9)
    meta = dict(snap.meta)
    if "dtype" in bad:
        meta["entries"] = [[bad["dtype"], [1024], 0, 4096]]
    else:
        meta.update(bad)
    snap.meta = meta
    with pytest.raises(ProtocolError, match="refused"):
        push_snapshot(("127.0.0.1", srv.port), snap, secret=SECRET, node="n1")
    assert srv.counts["refused_invalid"] == 1
    assert _tree(store.root) == before


def test_bad_dtype_never_reaches_torch() -> None:
    with pytest.raises(ValueError, match="not allowed"):
        jsoncodec.loads('{"$torch": ["dtype", "load"]}')
    with pytest.raises(ValueError, match="not allowed"):
        jsoncodec.loads('{"$tensor": {"dtype": "manual_seed", "shape": [0], "data": ""}}')
    assert jsoncodec.loads(jsoncodec.dumps(torch.bfloat16)) is torch.bfloat16


def test_transfer_cut_short_leaves_nothing(served) -> None:
    srv, store = served
    before = _tree(store.root)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.settimeout(5)
        ch = Channel(s, SECRET, server=False)
        ch.send({"op": "put", "node": "n1", "meta": _meta(4, 1 << 20), "nbytes": 1 << 20})
        assert ch.recv() == {"ok": True}
        s.sendall(os.urandom(100_000))  # a tenth of it, then the connection drops
    _wait(lambda: srv.counts["failed"] == 1)
    assert _tree(store.root) == before


def test_fill_from_a_silent_peer_ends_at_its_deadline(sender) -> None:
    """A peer that accepts the connection and never answers: skipped at the deadline."""
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen()
        peers = {1: {"host": "127.0.0.1", "port": lst.getsockname()[1], "node": "mute"}}
        skipped: dict[int, str] = {}
        t0 = time.monotonic()
        got = collect(
            sender,
            peers,
            3,
            2,
            secret=SECRET,
            deadline=time.monotonic() + 1.0,
            max_bytes=1 << 20,
            skipped=skipped,
        )
        assert got == [] and list(skipped) == [1] and "Timeout" in skipped[1]
        assert time.monotonic() - t0 < 10


@pytest.fixture
def full_tier(tmp_path: Path):
    """A receiving tier on a 1 MiB tmpfs (mounted here; root needed), else one whose store
    reports no free space."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        == 0
    )
    store = TierStore(mnt)
    if not mounted:
        store.free_bytes = lambda: 0  # type: ignore[method-assign]
    try:
        yield store
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_push_to_a_full_peer_backs_off(full_tier: TierStore, sender: TierStore) -> None:
    srv = TierServer(("127.0.0.1", 0), full_tier, secret=SECRET)
    srv.set_entitled({0, 1}, 2)
    srv.start()
    events: list[dict] = []
    rep = Replicator(
        sender,
        node="n0",
        backoff_s=0.1,
        backoff_max_s=0.8,
        emit=lambda kind, **f: events.append({"kind": kind, **f}),
    )
    try:
        _local_snapshot(sender, 1, nbytes=2 << 20)  # 2 MiB: does not fit on the 1 MiB tier
        before = _tree(full_tier.root)
        rep.set_peers(0, {1: {"host": "127.0.0.1", "port": srv.port, "node": "n1"}}, SECRET)
        rep.start()
        t0 = time.monotonic()
        time.sleep(3.0)  # the window attempts are counted in
        window = time.monotonic() - t0
        rep.stop()
        refused = srv.counts["refused_space"]
        # 0.1 + 0.2 + 0.4 + 0.8 + 0.8 ... s apart: about 6 in 3 s (10 ms apart before: ~300)
        assert 3 <= refused <= 2 + window / 0.8 + 4, refused
        assert rep.failures == refused == len(events)
        assert events[-1]["kind"] == "checkpoint_peer_push_failed"
        assert events[-1]["retry_in_s"] == 0.8 and "no space" in events[-1]["error"]
        assert _tree(full_tier.root) == before
    finally:
        rep.stop()
        srv.stop()


def test_route_ip() -> None:
    assert route_ip("") == "127.0.0.1"
    assert route_ip("localhost:29500") == "127.0.0.1"
    assert route_ip("127.0.0.1:29500") == "127.0.0.1"
    assert route_ip("[::1]:29500") == "127.0.0.1"


# -- replay, the returned step, pre-auth exhaustion ----------------------------------------------
class _RecordingProxy:
    """A man in the middle on loopback: in ``record`` mode it forwards both ways and keeps what
    the server sent; in ``replay`` mode it answers a new client with those bytes (ignoring
    whatever the client sends), as an on-path attacker replays a recorded answer."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        import threading

        self.upstream = upstream
        self.recorded = b""
        self.mode = "record"
        self.lst = socket.socket()
        self.lst.bind(("127.0.0.1", 0))
        self.lst.listen()
        self.port = self.lst.getsockname()[1]
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import threading

        while not self._stop:
            try:
                conn, _ = self.lst.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        import threading

        with conn:
            if self.mode == "replay":
                try:
                    conn.sendall(self.recorded)
                    time.sleep(2.0)  # open while the client reads, finds the MACs wrong
                except OSError:
                    pass  # the client hung up
                return
            with socket.create_connection(self.upstream, timeout=10) as up:

                def pump_up() -> None:
                    try:
                        while data := conn.recv(65536):
                            up.sendall(data)
                    except OSError:
                        pass

                threading.Thread(target=pump_up, daemon=True).start()
                got = b""
                while data := up.recv(65536):
                    got += data
                    conn.sendall(data)
                self.recorded = got

    def close(self) -> None:
        self._stop = True
        self.lst.close()


def test_a_recorded_answer_replayed_later_is_refused(served, tmp_path: Path) -> None:
    """A fetch recorded on the way (step 5), replayed when the peer holds step 9: the client's
    own nonce is in every MAC, so the stale answer never verifies."""
    srv, store = served
    write_snapshot(rank_dir(store.local, 0), _meta(5, 4096), os.urandom(4096))
    proxy = _RecordingProxy(("127.0.0.1", srv.port))
    try:
        kw = dict(secret=SECRET, rank=0, world_size=2, max_bytes=1 << 20)
        meta = fetch_snapshot(("127.0.0.1", proxy.port), dest=tmp_path / "a.bin", **kw)
        assert meta is not None and meta["step"] == 5
        _wait(lambda: len(proxy.recorded) > 4096)
        write_snapshot(rank_dir(store.local, 0), _meta(9, 4096), os.urandom(4096))
        proxy.mode = "replay"
        with pytest.raises(ProtocolError, match="authentication|MAC"):
            fetch_snapshot(("127.0.0.1", proxy.port), dest=tmp_path / "b.bin", **kw)
        assert not (tmp_path / "b.bin").exists()
        # straight to the peer: its newest
        meta = fetch_snapshot(("127.0.0.1", srv.port), dest=tmp_path / "c.bin", **kw)
        assert meta is not None and meta["step"] == 9
    finally:
        proxy.close()


def test_a_step_not_below_the_one_asked_for_is_refused(tmp_path: Path) -> None:
    """A peer that knows the secret but answers a snapshot at or above ``below`` (a newer one
    than the rollback asked for): refused, nothing written."""
    import threading

    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen()
    src = tmp_path / "snap.bin"
    src.write_bytes(os.urandom(4096))

    def serve() -> None:
        conn, _ = lst.accept()
        with conn:
            conn.settimeout(10)
            ch = Channel(conn, SECRET, server=True)
            req = ch.recv()
            assert req["below"] == 5
            try:
                ch.send({"found": True, "meta": _meta(9, 4096), "nbytes": 4096})
                ch.send_file(src, 4096, lambda: True)
            except OSError:
                pass  # the client hung up at the header, as it should

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with pytest.raises(ProtocolError, match="below 5, got step 9"):
            fetch_snapshot(
                ("127.0.0.1", lst.getsockname()[1]), secret=SECRET, rank=0, world_size=2,
                dest=tmp_path / "got.bin", below=5, max_bytes=1 << 20,
            )  # fmt: skip
        assert not (tmp_path / "got.bin").exists()
    finally:
        t.join(10)
        lst.close()


def test_a_large_header_announced_before_authentication_is_never_read(served) -> None:
    """The client's first bytes are a fixed-size proof of the secret: a 4 MiB length there is
    refused at once (no wait for, no buffer of, the announced header)."""
    srv, _store = served
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.settimeout(10)
        assert s.recv(len(MAGIC) + NONCE_LEN, socket.MSG_WAITALL)[: len(MAGIC)] == MAGIC
        s.sendall(struct.pack(">I", 4 << 20) + os.urandom(60))
        t0 = time.monotonic()
        assert s.recv(1) == b""  # closed, not waiting for 4 MiB
        assert time.monotonic() - t0 < 5
    _wait(lambda: srv.counts["refused_auth"] == 1)


def test_reconnecting_sockets_without_the_secret_do_not_keep_fetches_out(
    served, tmp_path: Path
) -> None:
    """128 sockets from another address that connect, stay silent and reconnect as soon as
    they are dropped (twice the pending limit): every fetch of the job's own still succeeds
    (oldest-first eviction, a per-address cap, a short authentication deadline)."""
    import threading

    srv, store = served
    write_snapshot(rank_dir(store.local, 0), _meta(3, 4096), os.urandom(4096))
    stop = threading.Event()

    def hog() -> None:
        while not stop.is_set():
            try:
                s = socket.create_connection(
                    ("127.0.0.1", srv.port), timeout=5, source_address=("127.0.0.2", 0)
                )
            except OSError:
                time.sleep(0.01)
                continue
            with s:
                try:
                    s.settimeout(10)
                    while not stop.is_set() and s.recv(4096):
                        pass  # never answers; reconnects once dropped
                except OSError:
                    pass

    hogs = [threading.Thread(target=hog, daemon=True) for _ in range(128)]
    for t in hogs:
        t.start()
    try:
        _wait(lambda: srv.counts["evicted_pending"] > 100, timeout=60)
        ok = 0
        for i in range(10):
            meta = fetch_snapshot(
                ("127.0.0.1", srv.port), secret=SECRET, rank=0, world_size=2,
                dest=tmp_path / f"f{i}.bin", max_bytes=1 << 20,
                deadline=time.monotonic() + 20,
            )  # fmt: skip
            ok += meta is not None and meta["step"] == 3
        assert ok == 10
        assert len(srv._pending) <= srv.max_pending
    finally:
        stop.set()
        for t in hogs:
            t.join(15)
