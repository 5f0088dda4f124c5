"""The memory tier's secret from a file: never published in the rendezvous store, the same key
on every node of the job, refused with one line when the file is unsafe. Two real agent plugins
("nodes") sharing a real TCPStore replicate through real tier servers with it."""

from __future__ import annotations

import os
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed import TCPStore

from trainguard.checkpoint import jsoncodec
from trainguard.checkpoint.memtier.plugin import MemoryTierPlugin
from trainguard.checkpoint.memtier.secret import SECRET_KEY, load_secret_file
from trainguard.checkpoint.memtier.store import write_snapshot
from trainguard.checkpoint.staging import list_snapshots, rank_dir
from trainguard.core.config import TrainGuardConfig
from trainguard.core.config.checkpoint import CheckpointConfig
from trainguard.core.events import EventLog
from trainguard.core.plugin import AgentContext
from trainguard.testing.ports import free_port


def _secret_file(tmp_path: Path, content: bytes = b"0123456789abcdef0123456789abcdef\n") -> Path:
    p = tmp_path / "tier.secret"
    p.write_bytes(content)
    p.chmod(0o600)
    return p


def test_unsafe_secret_files_are_refused_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot open it"):
        load_secret_file(str(tmp_path / "missing"), run_id="j")
    p = _secret_file(tmp_path)
    p.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_secret_file(str(p), run_id="j")
    short = _secret_file(tmp_path, b"short\n")
    with pytest.raises(ValueError, match="at least 16 needed"):
        load_secret_file(str(short), run_id="j")


def test_secret_file_key_is_per_job(tmp_path: Path) -> None:
    p = _secret_file(tmp_path)
    a = load_secret_file(str(p), run_id="job-a")
    assert a == load_secret_file(str(p), run_id="job-a") and len(a) == 32
    assert a != load_secret_file(str(p), run_id="job-b")
    assert p.read_bytes().strip() not in a


def _plugin(tmp_path: Path, node: str, secret_file: Path | None) -> MemoryTierPlugin:
    cfg = TrainGuardConfig(
        checkpoint=CheckpointConfig(
            memory_root=str(tmp_path),
            memory_secret_file=str(secret_file) if secret_file else None,
            peer_backoff_s=0.05,
        )
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    ctx = AgentContext(
        config=cfg,
        run_dir=run_dir,
        events=EventLog(run_dir, node=node),
        launch_config=SimpleNamespace(run_id="job-1", rdzv_endpoint="127.0.0.1:1"),
        attempt=0,
    )
    plugin = MemoryTierPlugin(ctx)
    plugin._ctx = ctx  # type: ignore[attr-defined]  # for _round below
    return plugin


def _round(plugins: list[MemoryTierPlugin], store: TCPStore) -> None:
    errors: list[BaseException] = []

    def one(g: int, p: MemoryTierPlugin) -> None:
        worker = SimpleNamespace(global_rank=g, world_size=2)
        group = SimpleNamespace(group_rank=g, group_world_size=2, store=store, workers=[worker])
        try:
            p.after_rendezvous(p._ctx, group)  # type: ignore[attr-defined, arg-type]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(g, p)) for g, p in enumerate(plugins)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


@pytest.mark.parametrize("from_file", [True, False])
def test_two_nodes_replicate_and_the_file_secret_is_never_published(
    tmp_path: Path, from_file: bool
) -> None:
    secret_file = _secret_file(tmp_path) if from_file else None
    store = TCPStore("127.0.0.1", free_port(), None, True, timeout=timedelta(seconds=30))
    plugins = [_plugin(tmp_path, f"n{i}", secret_file) for i in range(2)]
    try:
        _round(plugins, store)
        assert plugins[0].secret == plugins[1].secret is not None
        assert store.check([SECRET_KEY]) is (not from_file)
        if from_file:
            assert plugins[0].secret == load_secret_file(str(secret_file), run_id="job-1")
        # each node replicates its own rank to the other; the other accepts only that rank
        assert plugins[1]._server is not None and plugins[1]._server.entitled[0] == {0}
        meta = {
            "step": 4,
            "rank": 0,
            "world_size": 2,
            "gen": uuid.uuid4().hex,
            "time": time.time(),
            "nbytes": 64,
            "entries": [["float32", [16], 0, 64]],
            "skeleton": jsoncodec.dumps({"w": None}),
            "source": "memory",
        }
        payload = os.urandom(64)
        write_snapshot(rank_dir(plugins[0].local, 0), meta, payload)
        deadline = time.monotonic() + 30
        while not list_snapshots(rank_dir(plugins[1].replica, 0)):
            assert time.monotonic() < deadline, "the snapshot never reached the peer"
            time.sleep(0.05)
        [got] = list_snapshots(rank_dir(plugins[1].replica, 0))
        assert got.bin_path.read_bytes()[:64] == payload and got.source == "peer:n0"
    finally:
        for p in plugins:
            p.close()
        del store
