"""One reader for every secret file (trainguard.core.secretfile): the fleet's job secret and the
memory tier's ``memory_secret_file`` share its checks, each with its own advice."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from trainguard.checkpoint.memtier.secret import load_secret_file as tier_secret
from trainguard.core.fleetauth import load_secret_file as fleet_secret

PACKAGE = Path(__file__).resolve().parents[1] / "trainguard"


def _file(path: Path, content: str, mode: int = 0o600) -> Path:
    path.write_text(content)
    os.chmod(path, mode)
    return path


def test_both_readers_refuse_the_same_files_each_with_its_advice(tmp_path: Path) -> None:
    good = _file(tmp_path / "good", "x" * 32)
    assert fleet_secret(good) == b"x" * 32
    assert len(tier_secret(str(good), run_id="j")) == 32

    loose = _file(tmp_path / "loose", "x" * 32, 0o640)
    with pytest.raises(ValueError, match=r"mode 640\); delete it \(the next agent") as e:
        fleet_secret(loose)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"mode 640\); chmod 600 it$"):
        tier_secret(str(loose), run_id="j")

    short = _file(tmp_path / "short", "abc")
    with pytest.raises(ValueError, match=r"3 bytes, at least 16 needed; delete it$"):
        fleet_secret(short)
    with pytest.raises(ValueError, match=r"3 bytes, at least 16 needed \(e\.g\. `head"):
        tier_secret(str(short), run_id="j")

    with pytest.raises(ValueError, match=r"not a regular file; delete it$"):
        fleet_secret(tmp_path)
    with pytest.raises(ValueError, match=r"not a regular file$"):
        tier_secret(str(tmp_path), run_id="j")

    # a symlink: the job secret is trainguard's own file (never followed); a user's file may be
    # one (a mounted secret)
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(ValueError, match=r"cannot open it .*; delete it or fix its path$"):
        fleet_secret(link)
    assert tier_secret(str(link), run_id="j") == tier_secret(str(good), run_id="j")


def test_no_module_checks_a_secret_file_s_mode_itself() -> None:
    """The group/other-readable check (``st_mode & 0o077``) is spelled once."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.BitAnd):
                if any(isinstance(x, ast.Constant) and x.value == 0o077 for x in (n.left, n.right)):
                    found.append(f"{path.relative_to(PACKAGE)}:{n.lineno}")
    assert found and all(f.startswith("core/secretfile.py:") for f in found), found
