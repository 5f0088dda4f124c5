"""A malformed or hostile memory-tier snapshot never crashes a worker or an agent: it is refused
with one line and an event, and recovery falls back to the next source (an older snapshot, a
peer, the disk) on every rank together. Real gloo processes; a real tier server for the fill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.launch_utils import base_env, free_port
from trainguard.checkpoint import jsoncodec
from trainguard.checkpoint.memtier.replication import collect
from trainguard.checkpoint.memtier.server import TierServer
from trainguard.checkpoint.memtier.store import TierStore, write_snapshot
from trainguard.checkpoint.staging import list_snapshots, rank_dir

HOSTILE = ['{"w": {"$ref": 7}}', '{"$dict": [[[1], 2]]}', '{"a": [[[[', 17]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.core.config.checkpoint import CheckpointConfig

    phase, ckpt, mem, out = sys.argv[1:5]
    dist.init_process_group("gloo")
    events = []
    cfg = CheckpointConfig(dir=ckpt, collective_timeout_s=60)
    model = torch.nn.Linear(4, 4)
    state = {"model": model}
    mgr = CheckpointManager(
        config=cfg,
        events=lambda kind, **f: events.append({"kind": kind, **f}),
        memory_dir=mem,
        install_signal_handlers=False,
    )
    if phase == "save":
        with torch.no_grad():
            model.weight.fill_(3.0)
        assert mgr.save(3, state).wait(timeout=60)
        with torch.no_grad():
            model.weight.fill_(5.0)
        assert mgr.save(5, state, persist=False).wait_staged(timeout=60)
    else:
        with torch.no_grad():
            model.weight.zero_()
        step = mgr.restore(state)
        with open(out, "w") as f:
            json.dump({"step": step, "w": model.weight[0, 0].item(), "events": events}, f)
    mgr.close()
    dist.destroy_process_group()
    """
)


def _run_pair(tmp: Path, phase: str, ckpt: Path, mem: Path) -> list[dict]:
    script = tmp / "ckpt_pair.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = []
    for r in range(2):
        env = base_env()
        env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(tmp / f"{phase}_{r}.log", "w")  # noqa: SIM115 - closed below
        cmd = [
            sys.executable,
            str(script),
            phase,
            str(ckpt),
            str(mem),
            str(tmp / f"{phase}_{r}.json"),
        ]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for p, _ in procs:
            p.wait(timeout=300)  # a loaded machine: imports alone may take a minute
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = [(tmp / f"{phase}_{r}.log").read_text() for r in range(2)]
    assert [p.returncode for p, _ in procs] == [0, 0], logs
    if phase == "save":
        return []
    return [json.loads((tmp / f"{phase}_{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_hostile_memory_snapshot_falls_back_to_disk_on_every_rank(tmp_path: Path) -> None:
    """The fallback taken by every rank together, in a real 2-rank gloo job, for one hostile
    skeleton; each skeleton's refusal by the restore is checked in one process below."""
    skeleton = HOSTILE[0]
    ckpt, mem = tmp_path / "ckpt", tmp_path / "mem"
    mem.mkdir()
    _run_pair(tmp_path, "save", ckpt, mem)
    snaps = list_snapshots(rank_dir(mem, 1))
    assert [s.step for s in snaps] == [5, 3]  # the save of step 3 staged one too
    for snap in snaps:  # both of rank 1's snapshots hostile: memory 5, memory 3, then disk
        snap.meta_path.write_text(json.dumps(dict(snap.meta, skeleton=skeleton)))
    got = _run_pair(tmp_path, "restore", ckpt, mem)
    assert [g["step"] for g in got] == [3, 3]  # both ranks: the disk checkpoint, together
    assert [g["w"] for g in got] == [3.0, 3.0]
    corrupt = [e for e in got[1]["events"] if e["kind"] == "checkpoint_corrupt"]
    assert [(e["step"], e["source"], e["dropped"]) for e in corrupt] == [
        (5, "memory", True),
        (3, "memory", True),
    ]
    assert list_snapshots(rank_dir(mem, 1)) == []  # never tried again by a later restart
    assert [s.step for s in list_snapshots(rank_dir(mem, 0))] == [5, 3]
    for g in got:
        restored = [e for e in g["events"] if e["kind"] == "checkpoint_restored"]
        assert [(e["step"], e["source"]) for e in restored] == [(3, "disk")]
    log = (tmp_path / "restore_1.log").read_text()
    assert "Traceback" not in log
    assert sum("snapshot of step 5 refused" in line for line in log.splitlines()) == 1


@pytest.mark.parametrize("skeleton", HOSTILE)
def test_restore_refuses_a_hostile_memory_snapshot_and_loads_the_disk_one(
    tmp_path: Path, skeleton: object
) -> None:
    """One process (no process group): the restore refuses the hostile snapshots (memory 5,
    memory 3) with one line and an event each, drops them, and loads the disk checkpoint."""
    import logging

    import torch

    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.core.config.checkpoint import CheckpointConfig

    mem = tmp_path / "mem"
    mem.mkdir()
    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"))
    model = torch.nn.Linear(4, 4)
    mgr = CheckpointManager(config=cfg, memory_dir=mem, install_signal_handlers=False)
    with torch.no_grad():
        model.weight.fill_(3.0)
    assert mgr.save(3, {"model": model}).wait(timeout=60)
    with torch.no_grad():
        model.weight.fill_(5.0)
    assert mgr.save(5, {"model": model}, persist=False).wait_staged(timeout=60)
    mgr.close()
    snaps = list_snapshots(rank_dir(mem, 0))
    assert [s.step for s in snaps] == [5, 3]
    for snap in snaps:
        snap.meta_path.write_text(json.dumps(dict(snap.meta, skeleton=skeleton)))
    events: list[dict] = []
    mgr = CheckpointManager(
        config=cfg,
        memory_dir=mem,
        events=lambda kind, **f: events.append({"kind": kind, **f}),
        install_signal_handlers=False,
    )
    with torch.no_grad():
        model.weight.zero_()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainguard").addHandler(handler)
    try:
        assert mgr.restore({"model": model}) == 3
    finally:
        logging.getLogger("trainguard").removeHandler(handler)
        mgr.close()
    assert model.weight[0, 0].item() == 3.0
    corrupt = [e for e in events if e["kind"] == "checkpoint_corrupt"]
    assert [(e["step"], e["source"], e["dropped"]) for e in corrupt] == [
        (5, "memory", True),
        (3, "memory", True),
    ]
    restored = [e for e in events if e["kind"] == "checkpoint_restored"]
    assert [(e["step"], e["source"]) for e in restored] == [(3, "disk")]
    assert list_snapshots(rank_dir(mem, 0)) == []
    assert sum("snapshot of step 5 refused" in line for line in lines) == 1


def _meta(step: int, skeleton: str, nbytes: int = 64) -> dict:
    return {
        "step": step,
        "rank": 0,
        "world_size": 2,
        "gen": uuid.uuid4().hex,
        "time": time.time(),
        "nbytes": nbytes,
        "entries": [["float32", [nbytes // 4], 0, nbytes]],
        "skeleton": skeleton,
        "source": "memory",
    }


@pytest.mark.parametrize("skeleton", HOSTILE[:3])
def test_fill_refuses_a_hostile_snapshot_and_takes_the_next_peer(
    tmp_path: Path, skeleton: str
) -> None:
    secret = os.urandom(32)
    stores, servers = {}, {}
    for name in ("hostile", "good", "me"):
        (tmp_path / name).mkdir()
        stores[name] = TierStore(tmp_path / name)
    write_snapshot(rank_dir(stores["hostile"].local, 0), _meta(9, skeleton), os.urandom(64))
    good = jsoncodec.dumps({"w": None})
    write_snapshot(rank_dir(stores["good"].replica, 0), _meta(7, good), os.urandom(64))
    try:
        for name in ("hostile", "good"):
            servers[name] = TierServer(("127.0.0.1", 0), stores[name], secret=secret)
            servers[name].start()
        peers = {
            1: {"host": "127.0.0.1", "port": servers["hostile"].port, "node": "hostile"},
            2: {"host": "127.0.0.1", "port": servers["good"].port, "node": "good"},
        }
        skipped: dict[int, str] = {}
        got = collect(
            stores["me"],
            peers,
            0,
            2,
            secret=secret,
            deadline=time.monotonic() + 30,
            max_bytes=1 << 20,
            skipped=skipped,
        )
        assert [(src, m["step"]) for src, m, _ in got] == [("peer:good", 7)]
        assert list(skipped) == [1] and "skeleton" in skipped[1]
        for _, _, tmp in got:
            tmp.unlink()
        assert list((tmp_path / "me").rglob("*.bin")) == []
    finally:
        for srv in servers.values():
            srv.stop()
