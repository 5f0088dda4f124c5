"""Suite-wide safety net for processes.

Every test ends what it started, by PID (tests/procs.py helps). As a net under that, pytest
adopts orphans (a worker whose launcher a test killed) as a child subreaper; a process that a
test's body started and that still lives after the test's teardown is listed in the summary,
and every process still alive at the end of the session is SIGKILLed by PID.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import become_subreaper, descendants, kill_tree, reap

_LEFT: list[str] = []
_BEFORE_CALL: dict[str, set[int]] = {}


def pytest_configure(config: pytest.Config) -> None:
    become_subreaper()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _BEFORE_CALL[item.nodeid] = set(descendants(os.getpid()))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    reap()
    before = _BEFORE_CALL.pop(item.nodeid, None)
    if before is None:
        return
    for pid in descendants(os.getpid()):
        if pid not in before:
            _LEFT.append(f"{item.nodeid}: PID {pid} still running: {_cmdline(pid)}")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def pytest_sessionfinish(session: pytest.Session) -> None:
    for pid in descendants(os.getpid()):
        kill_tree(pid)
    reap()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _LEFT:
        terminalreporter.section("processes a test started and left running")
        for line in _LEFT:
            terminalreporter.line(line)
