"""Peer replication of the memory tier: two agents ("nodes") on one machine; one agent is killed
with its worker (kill -9 of the whole process group) and a replacement agent with an empty
memory tier joins. The replacement's worker restores from the survivor's in-memory copy (not
from disk: checkpoints to disk are off), the source is recorded in events, and training ends
bitwise-identical to a straight run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch_utils import REPO, base_env, free_port, log_excerpt, steps_done, wait_listening
from tests.mlp_reference import assert_same_as_reference
from tests.procs import descendants

EXAMPLE = str(REPO / "examples" / "train_mlp.py")
STEPS = "60"
KILL_AFTER = 20  # steps done when node b is killed


def _agent(tmp: Path, name: str, port: int, run_dir: Path, out: Path) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "trainguard", "run",
        "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "peer-test",
        "--max-restarts", "3", "--monitor-interval", "0.2",
        "--tg-run-dir", str(run_dir),
        EXAMPLE, "--steps", STEPS, "--step-sleep", "0.15",
        "--ckpt-every", "100000",  # memory tier only
        "--out", str(out),
    ]  # fmt: skip
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    # torch's dynamic rendezvous with a shared agent TCP store deadlocks when a new node joins a
    # later round (the old rank 0 does not republish MASTER_ADDR/PORT for that round); without
    # store sharing every round publishes them.
    env = base_env()
    return subprocess.Popen(
        args, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x]


@pytest.mark.slow
def test_replacement_node_restores_from_peer_memory(tmp_path: Path) -> None:
    port = free_port()
    run_dir = tmp_path / "run"
    out = tmp_path / "final.pt"
    procs = []
    try:
        a = _agent(tmp_path, "a", port, run_dir, out)
        procs.append(a)
        wait_listening(port, timeout=60)  # agent a hosts the rendezvous store
        b = _agent(tmp_path, "b", port, run_dir, out)
        procs.append(b)
        deadline = time.monotonic() + 150
        while steps_done(run_dir) < KILL_AFTER:
            assert time.monotonic() < deadline, log_excerpt(tmp_path / "b.log")
            assert a.poll() is None, log_excerpt(tmp_path / "a.log")
            assert b.poll() is None, log_excerpt(tmp_path / "b.log")
            time.sleep(0.2)
        for pid in [b.pid, *descendants(b.pid)]:  # node b is gone: agent and worker
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        b.wait(timeout=30)
        c = _agent(tmp_path, "c", port, run_dir, out)
        procs.append(c)
        # the logs' excerpts keep the cause of an error (the store's own exception under
        # torch's RendezvousConnectionError), which their tails cut off
        assert a.wait(timeout=240) == 0, log_excerpt(tmp_path / "a.log")
        assert c.wait(timeout=60) == 0, log_excerpt(tmp_path / "c.log")
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()

    events = _events(run_dir)
    restored = [e for e in events if e["kind"] == "checkpoint_restored" and e.get("step")]
    assert restored, [e["kind"] for e in events]
    sources = {e["source"] for e in restored}
    assert "peer_memory" in sources, restored
    assert "disk" not in sources
    assert len({e["step"] for e in restored}) == 1 and restored[0]["step"] >= KILL_AFTER
    filled = [e for e in events if e["kind"] == "checkpoint_memory_filled"]
    assert filled and any(str(e["snapshot_source"]).startswith("peer:") for e in filled), filled

    assert_same_as_reference(out, int(STEPS))  # a fault-free run's weights
