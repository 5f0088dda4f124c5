"""TRL's GRPOTrainer generating on a real engine process through ``rollout_func``
(examples/trl_grpo_fleet.py), under trainguard run with 2 ranks. One engine (a torch +
transformers import): the client's routing across engines and its weight sync to every one of
them are tests/test_rl_fleet.py's (three real engines); here TRL's side of the refit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fleet_engines import LocalEngines, engine_health
from tests.launch_utils import REPO, base_env, launch
from trainguard.rl import WeightStore
from trainguard.testing.ports import free_port


@pytest.mark.slow
def test_trl_grpo_trains_on_the_fleet(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    engines = LocalEngines([free_port()], run_dir=run_dir)
    engines.start()
    try:
        env = base_env(
            TRAINGUARD_ROLLOUT_URLS=",".join(engines.urls),
            TRAINGUARD_ROLLOUT_TOKEN=engines.token,
            OMP_NUM_THREADS="1",
        )
        res = launch(
            "trainguard",
            ["--standalone", "--nproc-per-node", "2", "--tg-run-dir", str(run_dir),
             str(REPO / "examples" / "trl_grpo_fleet.py"), "--steps", "3"],
            cwd=tmp_path, env=env, timeout=400,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr[-4000:]
        assert "done: 3 steps, weight version 2, failures {}" in res.stdout
        cur = WeightStore(run_dir / "rl" / "weights").current()
        assert cur is not None and cur.version == 2  # published at steps 0, 1, 2
        for port in engines.ports:  # the engine was refit to the trainer's last version
            h = engine_health(port, token=engines.token)
            assert h is not None and h["weight_version"] == 2
    finally:
        engines.close()
