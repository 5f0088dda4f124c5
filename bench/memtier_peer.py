"""Memory-tier peer transfers: what the payload MAC costs, against the physical limit.

One snapshot of ``--size-mib`` (in ``/dev/shm`` where there is one) moved over loopback TCP
between two processes, three ways, side by side in one run:

- ``raw``: kernel ``sendfile`` into a socket, the receiver writing it to a new file in bounded
  chunks: the transfer with no MAC at all (what the tier did before its payload was
  authenticated; the physical limit of this machine's loopback + page cache);
- ``push``: :func:`trainguard.checkpoint.memtier.wire.push_snapshot` to a real ``TierServer``
  in another process (HMAC-SHA256 tree over the payload on both sides, overlapped with the
  transfer, checked before the replica is kept);
- ``fetch``: :func:`~trainguard.checkpoint.memtier.wire.fetch_snapshot` of the same snapshot
  back from that server.

Also the MAC alone: HMAC-SHA256 over the bytes on one thread (GB/s per core), and the tree
on every hashing thread the tier uses. Sender and receiver share this machine's cores, so on a
2-core box each byte is hashed twice on the same two cores; between two hosts each side hashes
on its own. Medians of ``--runs``. Ends with one JSON line.

    python bench/memtier_peer.py [--size-mib 256] [--runs 5]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainguard.checkpoint import jsoncodec  # noqa: E402
from trainguard.checkpoint.memtier import wire  # noqa: E402
from trainguard.checkpoint.memtier.store import TierStore, write_snapshot  # noqa: E402
from trainguard.checkpoint.staging import list_snapshots, rank_dir  # noqa: E402

SECRET = os.urandom(32)

_SERVER = r"""
import sys, time
from pathlib import Path
from trainguard.checkpoint.memtier.server import TierServer
from trainguard.checkpoint.memtier.store import TierStore
root = Path(sys.argv[1])
srv = TierServer(("127.0.0.1", 0), TierStore(root), secret=bytes.fromhex(sys.argv[2]))
srv.set_entitled({0}, 2)
srv.start()
print(srv.port, flush=True)
sys.stdin.read()
srv.stop()
"""

_RAW_SINK = r"""
import os, socket, sys
n = int(sys.argv[2])
ls = socket.create_server(("127.0.0.1", 0))
print(ls.getsockname()[1], flush=True)
while True:
    c, _ = ls.accept()
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    path = sys.argv[1] + ".raw"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "r+b", buffering=0) as f:
        done = 0
        while done < n:
            k = c.recv_into(view[: min(n - done, len(buf))])
            if not k:
                break
            f.write(view[:k])
            done += k
    c.sendall(b"k")
    c.close()
    os.unlink(path)
"""


def _meta(nbytes: int, step: int) -> dict:
    return {
        "step": step,
        "rank": 0,
        "world_size": 2,
        "gen": uuid.uuid4().hex,
        "time": time.time(),
        "nbytes": nbytes,
        "entries": [["float32", [nbytes // 4], 0, nbytes]],
        "skeleton": jsoncodec.dumps({"w": None}),
        "source": "memory",
    }


def _start(code: str, *args: str) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert p.stdout is not None
    return p, int(p.stdout.readline())


def _stop(p: subprocess.Popen) -> None:
    p.kill()
    p.wait()


def _hmac_gbps(data: bytes) -> float:
    t0 = time.perf_counter()
    hmac.new(SECRET, data, hashlib.sha256).digest()
    return len(data) / (time.perf_counter() - t0) / 1e9


def _tree_gbps(path: Path, nbytes: int) -> float:
    with open(path, "rb") as f:
        t0 = time.perf_counter()
        mac = wire.FileMac(SECRET, os.urandom(wire.NONCE_LEN), f.fileno(), nbytes)
        try:
            mac.hexdigest()
        finally:
            mac.close()
        return nbytes / (time.perf_counter() - t0) / 1e9


def _raw_gbps(port: int, path: Path, nbytes: int) -> float:
    with socket.create_connection(("127.0.0.1", port)) as s, open(path, "rb") as f:
        t0 = time.perf_counter()
        s.sendfile(f, 0, nbytes)
        assert s.recv(1) == b"k"
        return nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    nbytes = args.size_mib << 20
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="tg-bench-peer-", dir=base) as tmp:
        root = Path(tmp)
        (root / "send").mkdir()
        (root / "srv").mkdir()
        sender = TierStore(root / "send")
        payload = os.urandom(nbytes)
        write_snapshot(rank_dir(sender.local, 0), _meta(nbytes, 1), payload)
        snap = list_snapshots(rank_dir(sender.local, 0))[0]
        srv, port = _start(_SERVER, str(root / "srv"), SECRET.hex())
        sink, raw_port = _start(_RAW_SINK, str(root / "sink"), str(nbytes))
        res: dict[str, list[float]] = {"raw": [], "push": [], "fetch": [], "hmac": [], "tree": []}
        try:
            for i in range(args.runs):
                res["hmac"].append(_hmac_gbps(payload))
                res["tree"].append(_tree_gbps(snap.bin_path, nbytes))
                res["raw"].append(_raw_gbps(raw_port, snap.bin_path, nbytes))
                snap = list_snapshots(rank_dir(sender.local, 0))[0]
                t0 = time.perf_counter()
                wire.push_snapshot(("127.0.0.1", port), snap, secret=SECRET, node="bench")
                res["push"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                dest = root / f"fetched-{i}.bin"
                t0 = time.perf_counter()
                meta = wire.fetch_snapshot(
                    ("127.0.0.1", port),
                    secret=SECRET,
                    rank=0,
                    world_size=2,
                    dest=dest,
                    max_bytes=nbytes,
                )
                res["fetch"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                assert meta is not None and dest.stat().st_size == nbytes
                dest.unlink()
                # a newer step for the next push (the server keeps the newest)
                write_snapshot(rank_dir(sender.local, 0), _meta(nbytes, i + 2), payload)
                print(
                    f"run {i + 1}: raw {res['raw'][-1]:.2f}  push {res['push'][-1]:.2f}  "
                    f"fetch {res['fetch'][-1]:.2f}  hmac/core {res['hmac'][-1]:.2f}  "
                    f"tree {res['tree'][-1]:.2f} GB/s",
                    flush=True,
                )
        finally:
            _stop(srv)
            _stop(sink)
    med = {k: round(statistics.median(v), 3) for k, v in res.items()}
    print(
        f"\n{args.size_mib} MiB over loopback, {os.cpu_count()} cores, medians of {args.runs}:"
        f"\n  no MAC (sendfile -> file)   {med['raw']:.2f} GB/s   (physical limit)"
        f"\n  trainguard push            {med['push']:.2f} GB/s   ({med['push'] / med['raw']:.2f}x)"
        f"\n  trainguard fetch           {med['fetch']:.2f} GB/s   "
        f"({med['fetch'] / med['raw']:.2f}x)"
        f"\n  HMAC-SHA256, one core      {med['hmac']:.2f} GB/s"
        f"\n  MAC tree, {min(wire.MAC_THREADS, -(-nbytes // wire.SEGMENT))} threads"
        f"          {med['tree']:.2f} GB/s"
    )
    print(
        json.dumps(
            {
                "memtier_raw_gbps": med["raw"],
                "memtier_push_gbps": med["push"],
                "memtier_fetch_gbps": med["fetch"],
                "memtier_hmac_gbps_per_core": med["hmac"],
                "memtier_mac_tree_gbps": med["tree"],
                "size_mib": args.size_mib,
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
