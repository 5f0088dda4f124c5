"""``trainguard run`` with peer replication on, two agents on one machine: each memory-tier
server listens only on the rendezvous route's address (loopback here; checked with ``ss -ltnp``
for the agent's pid), the agents replicate to each other with the job's secret, and a client
without the secret gets the challenge and nothing else."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from tests.launch_utils import REPO, base_env, free_port, steps_done, wait_listening
from tests.procs import descendants
from tests.services.telemetry_services import apt_ensure
from trainguard.checkpoint.memtier.wire import MAGIC, NONCE_LEN

EXAMPLE = str(REPO / "examples" / "train_mlp.py")


def _agent(tmp: Path, name: str, port: int, run_dir: Path) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "trainguard", "run",
        "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "listen",
        "--monitor-interval", "0.2", "--tg-run-dir", str(run_dir),
        EXAMPLE, "--steps", "100000", "--step-sleep", "0.05", "--ckpt-every", "100000",
        "--out", str(tmp / f"{name}.pt"),
    ]  # fmt: skip
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        args, cwd=tmp, env=base_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _serving(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    evs = [json.loads(x) for x in lines if x]
    return [e for e in evs if e["kind"] == "checkpoint_memory_tier_serving"]


def _listening(pid: int) -> list[str]:
    """Local addresses (``host:port``) of the TCP sockets ``pid`` listens on."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if re.search(rf"pid={pid},", line)]


def _replicas(pid: int) -> list[Path]:
    return list(Path("/dev/shm").glob(f"trainguard-ckpt-{pid}-*/replica/rank_*/slot*.json"))


def test_tier_listens_on_the_route_and_refuses_strangers(tmp_path: Path) -> None:
    apt_ensure("iproute2")  # ss
    port = free_port()
    run_dir = tmp_path / "run"
    procs = []
    try:
        a = _agent(tmp_path, "a", port, run_dir)
        procs.append(a)
        wait_listening(port, timeout=60)
        b = _agent(tmp_path, "b", port, run_dir)
        procs.append(b)
        deadline = time.monotonic() + 180
        # both agents serve, and each holds a replica of the other's worker: the secret works
        while not (
            len(_serving(run_dir)) == 2
            and steps_done(run_dir) >= 3
            and all(_replicas(p.pid) for p in procs)
        ):
            assert time.monotonic() < deadline, (tmp_path / "b.log").read_text()[-3000:]
            assert a.poll() is None and b.poll() is None, (tmp_path / "a.log").read_text()[-3000:]
            time.sleep(0.2)
        ports = {e["port"] for e in _serving(run_dir)}
        assert {e["host"] for e in _serving(run_dir)} == {"127.0.0.1"}
        for p in procs:
            mine = [addr for addr in _listening(p.pid) if int(addr.rsplit(":", 1)[1]) in ports]
            assert len(mine) == 1 and mine[0].startswith("127.0.0.1:"), _listening(p.pid)

        for tier_port in ports:
            with socket.create_connection(("127.0.0.1", tier_port), timeout=10) as s:
                s.settimeout(10)
                h = json.dumps({"op": "get", "rank": 0, "world_size": 2, "below": None}).encode()
                s.sendall(struct.pack(">I", len(h)) + h + b"\0" * 32)  # no secret: a zero MAC
                got = b""
                while chunk := s.recv(65536):
                    got += chunk
            assert got[: len(MAGIC)] == MAGIC and len(got) == len(MAGIC) + NONCE_LEN
            assert a.poll() is None and b.poll() is None
    finally:
        for p in procs:
            for pid in [*descendants(p.pid), p.pid]:  # workers run in their own sessions
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=30)
