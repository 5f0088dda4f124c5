"""A tool the suite needs and the machine lacks is named in one line before the first test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.launch_utils import REPO, base_env
from tests.services import preflight


def test_every_tool_the_suite_runs_is_installed_here() -> None:
    # make test installed them; on a machine where one is missing the whole run stops at start
    assert preflight.missing() == []


def test_a_missing_etcdctl_stops_the_run_in_one_line_naming_its_package(tmp_path: Path) -> None:
    # A PATH with every tool but etcdctl, as on a machine whose install list lacks etcd-client.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for b in preflight.BINARIES:
        found = shutil.which(b, path=os.pathsep.join([os.environ["PATH"], *preflight._SBIN]))
        assert found, b
        if b != "etcdctl":
            (bin_dir / b).symlink_to(found)
    env = base_env()
    env["PATH"] = str(bin_dir)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_config.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout + r.stderr
    lines = [ln for ln in out.splitlines() if "not installed:" in ln]
    assert lines, out[-2000:]
    assert "not installed: etcdctl (Debian etcd-client);" in lines[0], lines[0]
    assert "passed" not in out and "failed" not in out, out[-2000:]
