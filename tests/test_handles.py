"""The protocols of the untyped seams hold for the real objects."""

from __future__ import annotations

from pathlib import Path


def test_the_worker_handle_is_what_its_components_take(tmp_path: Path) -> None:
    from trainguard.core.handles import WorkerHandle
    from trainguard.worker.api import TrainGuard

    tg = TrainGuard(run_dir=tmp_path)
    try:
        assert isinstance(tg, WorkerHandle)  # every member the protocol names
    finally:
        tg.close()
