"""Config precedence and validation (unit tests of the loader)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.core.config import ConfigError, load_config


def test_defaults() -> None:
    cfg = load_config(env={})
    assert cfg.runtime.run_dir is None
    assert cfg.runtime.heartbeat_interval_s == 1.0


def test_precedence_flag_file_env_default(tmp_path: Path) -> None:
    f = tmp_path / "tg.toml"
    f.write_text('[runtime]\nrun_dir = "from-file"\nheartbeat_interval_s = 2.5\n')
    env = {"TRAINGUARD_RUNTIME_RUN_DIR": "from-env", "TRAINGUARD_RUNTIME_RUNS_ROOT": "env-root"}
    cfg = load_config(str(f), env=env, overrides={"runtime.run_dir": "from-flag"})
    assert cfg.runtime.run_dir == "from-flag"
    assert cfg.runtime.heartbeat_interval_s == 2.5
    assert cfg.runtime.runs_root == "env-root"
    cfg = load_config(str(f), env=env, overrides={"runtime.run_dir": None})
    assert cfg.runtime.run_dir == "from-file"
    cfg = load_config(None, env=env)
    assert cfg.runtime.run_dir == "from-env"


def test_env_unknown_setting_named() -> None:
    with pytest.raises(ConfigError, match="TRAINGUARD_RUNTIME_NOPE"):
        load_config(env={"TRAINGUARD_RUNTIME_NOPE": "1"})


def test_post_init_validation_names_section(tmp_path: Path) -> None:
    f = tmp_path / "tg.toml"
    f.write_text("[runtime]\nheartbeat_interval_s = 0\n")
    with pytest.raises(ConfigError, match=r"\[runtime\].*heartbeat_interval_s"):
        load_config(str(f), env={})


def test_round_trip_json() -> None:
    import json

    cfg = load_config(env={})
    assert json.loads(cfg.to_json())["runtime"]["runs_root"] == "trainguard-runs"
