"""Nothing committed is ever deleted by a failure after the commit (the manifest's rename):
real saves on a real file system, the failure injected right after the commit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint import storage as storage_mod
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.storage import LocalStorage
from trainguard.core.config.checkpoint import CheckpointConfig


def _state() -> dict:
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    return {"model": m, "optim": torch.optim.SGD(m.parameters(), lr=0.1)}


def _mgr(root: Path) -> CheckpointManager:
    return CheckpointManager(
        config=CheckpointConfig(dir=str(root), memory_tier=False), install_signal_handlers=False
    )


def _restored(root: Path, want: torch.Tensor) -> int | None:
    state = _state()
    with torch.no_grad():
        state["model"].weight.zero_()
    mgr = _mgr(root)
    try:
        step = mgr.restore(state)
    finally:
        mgr.close()
    assert torch.equal(state["model"].weight, want)
    return step


def test_latest_unwritable_after_the_commit_keeps_the_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    state = _state()
    mgr = _mgr(root)
    try:
        assert mgr.save(1, state).wait(timeout=60)
        (root / "latest").unlink()
        (root / "latest").mkdir()  # `latest` cannot be replaced now (a directory, not empty)
        (root / "latest" / "x").write_text("x")
        with torch.no_grad():
            state["model"].weight.add_(1.0)
        want = state["model"].weight.detach().clone()
        res = mgr.save(2, state)
        assert res.wait(timeout=60), res.error
    finally:
        mgr.close()
    assert mf.committed_steps(LocalStorage(), str(root)) == [1, 2]
    assert _restored(root, want) == 2


def test_fsync_failing_after_the_manifest_rename_keeps_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    calls = {"n": 0}
    real = storage_mod.fsync_dir

    def failing_after_manifest(path: object) -> None:
        real(path)  # type: ignore[arg-type]
        if Path(str(path)) == root:  # the directory fsync after `latest`'s rename
            calls["n"] += 1
            raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(storage_mod, "fsync_dir", failing_after_manifest)
    state = _state()
    want = state["model"].weight.detach().clone()
    mgr = _mgr(root)
    try:
        res = mgr.save(3, state)
        assert res.wait(timeout=60), res.error
    finally:
        mgr.close()
    assert calls["n"] >= 1
    assert mf.committed_steps(LocalStorage(), str(root)) == [3]
    assert (root / "step_00000003").is_dir()
    assert _restored(root, want) == 3
