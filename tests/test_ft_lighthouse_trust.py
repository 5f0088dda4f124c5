"""Which lighthouse ``trainguard run --ft`` trusts on 127.0.0.1, and its host lock (real
processes: a plain HTTP server, one run as another user, a real torchft lighthouse, and a
process that holds the locks)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch_utils import free_port
from tests.procs import kill_tree
from trainguard.core.config.ft import FTConfig
from trainguard.ft.lighthouse import FTUnavailable, ensure_lighthouse, reachable

pytestmark = pytest.mark.ft


def _serve(port: int, *, user: int | None = None) -> subprocess.Popen[bytes]:
    """``python -m http.server`` on 127.0.0.1:``port`` (as ``user`` when given)."""
    python = "/usr/bin/python3" if user is not None else sys.executable
    p = subprocess.Popen(
        [python, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, user=user,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not reachable("127.0.0.1", port):
        assert p.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    return p


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        kill_tree(p.pid)
        p.wait(timeout=30)


def test_a_listener_that_is_not_a_lighthouse_is_refused(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    procs.append(_serve(port))
    with pytest.raises(FTUnavailable, match="not a torchft lighthouse listens on 127.0.0.1"):
        ensure_lighthouse(FTConfig(enabled=True, lighthouse_port=port), tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="starting another user's process needs root")
def test_another_users_listener_is_refused(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    procs.append(_serve(port, user=65534))
    with pytest.raises(FTUnavailable, match=r"held by another user's process \(uid 65534\)"):
        ensure_lighthouse(FTConfig(enabled=True, lighthouse_port=port), tmp_path)


def test_held_locks_never_block_the_launch(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """The lock file anyone could create and hold (the old /tmp path) is not used; the private
    one, held by a stuck launcher of this user, delays a launch by ``lock_timeout_s`` only."""
    port = free_port()
    old = Path(tempfile.gettempdir()) / f"trainguard-ft-lighthouse-{port}.lock"
    private = Path(tempfile.gettempdir()) / f"trainguard-{os.geteuid()}"
    if os.environ.get("XDG_RUNTIME_DIR"):
        private = Path(os.environ["XDG_RUNTIME_DIR"])
    private.mkdir(mode=0o700, exist_ok=True)
    for path in (old, private / f"ft-lighthouse-{port}.lock"):
        procs.append(subprocess.Popen(["flock", str(path), "sleep", "600"], start_new_session=True))
    deadline = time.monotonic() + 30
    while not (old.exists() and (private / f"ft-lighthouse-{port}.lock").exists()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # flock holds them
    got: list[object] = []

    def launch() -> None:
        try:
            got.append(
                ensure_lighthouse(
                    FTConfig(enabled=True, lighthouse_port=port), tmp_path, lock_timeout_s=1.0
                )
            )
        except BaseException as e:  # reported below
            got.append(e)

    t = threading.Thread(target=launch, daemon=True)
    t.start()
    t.join(150)
    assert not t.is_alive(), "the launch is blocked on a lock"
    lh = got[0]
    assert not isinstance(lh, BaseException), lh
    try:
        assert lh.pid is not None and reachable("127.0.0.1", port)  # type: ignore[attr-defined]
        # and a second launcher finds it, checked, instead of starting another
        again = ensure_lighthouse(
            FTConfig(enabled=True, lighthouse_port=port), tmp_path, lock_timeout_s=1.0
        )
        assert again.pid is None and again.url == lh.url  # type: ignore[attr-defined]
    finally:
        lh.stop()  # type: ignore[attr-defined]
    st = os.stat(private)
    assert st.st_uid == os.geteuid() and not st.st_mode & 0o022 and stat.S_ISDIR(st.st_mode)
