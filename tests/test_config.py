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


def test_warm_section_and_its_deprecated_settings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One ``[warm]`` section; the old ``[runtime] warm_*`` and ``[spares] warm_*`` settings are
    still read, into ``[warm]``, with one deprecation line each; the new name wins."""
    assert load_config(env={}).warm.enabled is True
    assert load_config(env={}, overrides={"warm.enabled": False}).warm.enabled is False
    f = tmp_path / "c.toml"
    f.write_text(
        '[runtime]\nwarm_prestart_delay_s = 2.0\nwarm_preload = ["json"]\n'
        '[spares]\nwarm_workers = "off"\n'
    )
    with caplog.at_level("WARNING", logger="trainguard.core.config"):
        cfg = load_config(str(f), env={"TRAINGUARD_WARM_PRESTART_DELAY_S": "9"})
    assert (cfg.warm.enabled, cfg.warm.preload, cfg.warm.prestart_delay_s) == (False, ["json"], 2.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all("\n" not in m and "deprecated" in m for m in lines)
    assert any("[spares] warm_workers" in m and "[warm] enabled = false" in m for m in lines)
    assert "warm_workers" not in cfg.to_json() and "warm_restarts" not in cfg.to_json()
    # env: the old variable maps too; the new one, set in the same source, wins
    env = {"TRAINGUARD_RUNTIME_WARM_RESTARTS": "false", "TRAINGUARD_SPARES_WARM_WORKERS": "on"}
    assert load_config(env=env).warm.enabled is False
    assert load_config(env={**env, "TRAINGUARD_WARM_ENABLED": "true"}).warm.enabled is True
    f.write_text('[spares]\nwarm_workers = "sometimes"\n')
    with pytest.raises(ConfigError, match=r"warm_workers.*use on, auto or off.*\[warm\] enabled"):
        load_config(str(f), env={})


def test_dir_mode_is_an_octal_mode_with_the_owners_bits() -> None:
    assert load_config(env={}).runtime.dir_mode_bits == 0o700
    assert load_config(env={"TRAINGUARD_RUNTIME_DIR_MODE": "0750"}).runtime.dir_mode_bits == 0o750
    for bad in ("0644", "rwx", "1777"):
        with pytest.raises((ConfigError, ValueError), match="dir_mode"):
            load_config(env={"TRAINGUARD_RUNTIME_DIR_MODE": bad})
