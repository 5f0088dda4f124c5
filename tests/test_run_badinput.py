"""Bad input to `trainguard run`: one line naming the problem and the fix, exit 2, no traceback.

The installed `trainguard` command is run for one case (the whole path from the console
script); the others call the same entry point in this process, with this test's directory and
environment, which is what the command runs and costs no interpreter start each."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.launch_utils import WORKERS, Result, launch
from trainguard.cli.main import main

DUMP = str(WORKERS / "dump_env.py")
# torch's error handler enables faulthandler on stderr, which pytest's capture has no fd for
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    """``run(args, **env)``: `trainguard run ARGS` in-process, in ``tmp_path``."""
    monkeypatch.chdir(tmp_path)
    for k in list(os.environ):
        if k.startswith(("PET_", "TORCHELASTIC_", "TRAINGUARD_")):
            monkeypatch.delenv(k)

    def call(args: list[str], **env: str) -> Result:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        capsys.readouterr()
        try:
            main(["run", *args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return call


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
def test_bad_nnodes(run, nnodes: str) -> None:
    r = run(["--nnodes", nnodes, DUMP])
    _check(r, "--nnodes", "MIN:MAX")


def test_missing_config(run) -> None:
    r = run(["--config", "nope.toml", "--standalone", DUMP])
    _check(r, "nope.toml", "does not exist")


def test_invalid_toml(tmp_path: Path, run) -> None:
    (tmp_path / "tg.toml").write_text("[runtime\nrun_dir = 3\n")
    r = run(["--config", "tg.toml", "--standalone", DUMP])
    _check(r, "tg.toml", "not valid TOML")


def test_unknown_key_and_bad_type(tmp_path: Path, run) -> None:
    (tmp_path / "a.toml").write_text("[runtime]\nrun_dri = 'x'\n")
    _check(
        run(["--config", "a.toml", "--standalone", DUMP]),
        "run_dri",
        "known keys",
    )
    (tmp_path / "b.toml").write_text("[runtime]\nheartbeat_interval_s = 'fast'\n")
    _check(
        run(["--config", "b.toml", "--standalone", DUMP]),
        "heartbeat_interval_s",
        "expected float",
    )
    (tmp_path / "c.toml").write_text("[nosuch]\nx = 1\n")
    _check(
        run(["--config", "c.toml", "--standalone", DUMP]),
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


def test_config_is_directory(tmp_path: Path, run) -> None:
    _check(run(["--config", str(tmp_path), "--standalone", DUMP]), "is a directory")


def test_bad_env_value(run) -> None:
    r = run(["--standalone", DUMP], TRAINGUARD_RUNTIME_HEARTBEAT_INTERVAL_S="-1")
    _check(r, "heartbeat_interval_s")


def test_router_port_taken(run, tmp_path: Path) -> None:
    """The fleet endpoint's port already taken: one line at submission, nothing started."""
    import socket
    import sys

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = tmp_path / "tg.toml"
        cfg.write_text(
            f"[roles]\nrouter = true\nrouter_port = {port}\n"
            f'[roles.rollout]\ncommand = "{sys.executable} -m tests.stub_engine"\n'
        )
        r = run(["--config", str(cfg), "--tg-run-dir", str(tmp_path / "run"), DUMP])
    _check(r, f"router_port {port}", "choose a free port")
    assert not (tmp_path / "run" / "roles").exists()
