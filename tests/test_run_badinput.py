"""Bad input to `trainguard run`: one line naming the problem and the fix, exit 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch_utils import WORKERS, base_env, launch

DUMP = str(WORKERS / "dump_env.py")


def _check(r, *needles: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_missing_script(tmp_path: Path) -> None:
    r = launch("trainguard", ["--standalone", "no_such_script.py"], cwd=tmp_path)
    _check(r, "no_such_script.py", "not found", "check the path")


@pytest.mark.parametrize("nnodes", ["abc", "2:1", "1:2:3", "0"])
def test_bad_nnodes(tmp_path: Path, nnodes: str) -> None:
    r = launch("trainguard", ["--nnodes", nnodes, DUMP], cwd=tmp_path)
    _check(r, "--nnodes", "MIN:MAX")


def test_missing_config(tmp_path: Path) -> None:
    r = launch("trainguard", ["--config", "nope.toml", "--standalone", DUMP], cwd=tmp_path)
    _check(r, "nope.toml", "does not exist")


def test_invalid_toml(tmp_path: Path) -> None:
    (tmp_path / "tg.toml").write_text("[runtime\nrun_dir = 3\n")
    r = launch("trainguard", ["--config", "tg.toml", "--standalone", DUMP], cwd=tmp_path)
    _check(r, "tg.toml", "not valid TOML")


def test_unknown_key_and_bad_type(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text("[runtime]\nrun_dri = 'x'\n")
    _check(
        launch("trainguard", ["--config", "a.toml", "--standalone", DUMP], cwd=tmp_path),
        "run_dri",
        "known keys",
    )
    (tmp_path / "b.toml").write_text("[runtime]\nheartbeat_interval_s = 'fast'\n")
    _check(
        launch("trainguard", ["--config", "b.toml", "--standalone", DUMP], cwd=tmp_path),
        "heartbeat_interval_s",
        "expected float",
    )
    (tmp_path / "c.toml").write_text("[nosuch]\nx = 1\n")
    _check(
        launch("trainguard", ["--config", "c.toml", "--standalone", DUMP], cwd=tmp_path),
        "[nosuch]",
        "known sections",
    )


def test_unreadable_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests run as root (CI too), and root reads a chmod-0 file; so the EACCES is injected.
    from trainguard.core.config import ConfigError, load_config

    cfg = tmp_path / "tg.toml"
    cfg.write_text("[runtime]\n")

    def deny(self: Path, *a: object, **k: object) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", deny)
    with pytest.raises(ConfigError, match="not readable.*chmod"):
        load_config(str(cfg), env={})


def test_config_is_directory(tmp_path: Path) -> None:
    _check(
        launch("trainguard", ["--config", str(tmp_path), "--standalone", DUMP], cwd=tmp_path),
        "is a directory",
    )


def test_bad_env_value(tmp_path: Path) -> None:
    env = base_env(TRAINGUARD_RUNTIME_HEARTBEAT_INTERVAL_S="-1")
    _check(
        launch("trainguard", ["--standalone", DUMP], cwd=tmp_path, env=env), "heartbeat_interval_s"
    )
