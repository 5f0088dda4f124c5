"""Suite-wide safety net for processes.

Every test ends what it started, by PID (tests/procs.py helps). As a net under that, pytest
adopts orphans (a worker whose launcher a test killed) as a child subreaper; a process that a
test's body started and that still lives after the test's teardown is listed in the summary,
and every process still alive at the end of the session is SIGKILLed by PID. Under
pytest-xdist each worker is its own subreaper and cleans up its own descendants.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.procs import FIXTURE_PIDS, alive, become_subreaper, descendants, kill_tree, reap

# Collection imports torch, transformers, lightning, ... (~4 000 modules) with the cyclic
# collector off: its full collections would walk every object imported so far, again and again
# (2-3 CPU s of each pytest process's 8). They are frozen once collected
# (pytest_collection_finish): long-lived module state that later collections skip.
gc.disable()

_LEFT: list[str] = []
_BEFORE_CALL: dict[str, set[int]] = {}
# CPU profile: per test, the CPU seconds of the pytest process and of every child it reaped
# (it is a subreaper, so orphaned grandchildren count too) from setup to teardown, and the
# wall time; the heaviest are printed at the end of the run (TG_PROFILE_TOP, default 15).
_CPU_START: dict[str, tuple[float, float, float]] = {}
_CPU: list[tuple[float, float, str, float, str]] = []
"""Per test: CPU s, wall s, nodeid, start (epoch seconds), the xdist worker that ran it."""


# Tests that start (or share) one kind of service carry its marker; each marker is also an
# xdist group, so under `pytest -n N --dist loadgroup` a group runs in one worker (its
# module-scoped services start once) while the rest spread over the others. `pytest -m slurm`
# runs one group.
SERVICE_GROUPS = {
    "etcd": "real etcd",
    "slurm": "a real Slurm cluster (munged, slurmctld, slurmd per node)",
    "prometheus": "real Prometheus, Alertmanager or the rotel OTLP receiver",
    "ft": "torchft's lighthouse",
    "chromium": "headless Chromium",
}


def pytest_configure(config: pytest.Config) -> None:
    become_subreaper()
    for name, what in SERVICE_GROUPS.items():
        config.addinivalue_line("markers", f"{name}: tests that start {what} (one xdist group)")
    if config.getoption("dist", "no") == "loadgroup":
        _refuse_ungrouped_loadgroup()


def _refuse_ungrouped_loadgroup() -> None:
    """The tests of one xdist group share their services and module jobs on one worker; with
    pytest 9.2 (an item's nodeid read from a new field) pytest-xdist 3.8's ``--dist loadgroup``
    no longer names the groups and silently schedules every test on its own."""
    import xdist
    from packaging.version import Version

    known = Version(xdist.__version__) <= Version("3.8.0")  # the pytest-xdist seen to break
    if Version(pytest.__version__) >= Version("9.2") and known:
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__}: --dist "
            "loadgroup would not group the tests; install the pytest that pyproject's test "
            "extra names (pytest<9.2; make test does)"
        )


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.freeze()  # what collection imported: module state, never garbage
    gc.enable()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        groups = [m.name for m in item.iter_markers() if m.name in SERVICE_GROUPS]
        if groups and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(groups[0]))
    # The longest tests first (a stable sort: collection order otherwise): xdist hands out the
    # groups (largest first), then single tests in this order, so the run does not end with one
    # worker still in a minute-long test while the others have nothing left.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionstart(session: pytest.Session) -> None:
    # Checked once, by the controller (an xdist worker has ``workerinput``), before any test.
    if hasattr(session.config, "workerinput") or os.environ.get("TG_SKIP_PREFLIGHT"):
        return
    from tests.services import preflight

    absent = preflight.missing()
    if absent:
        pytest.exit(preflight.message(absent), returncode=4)


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One etcd for every test of the ``etcd`` group that does not restart it (each uses its own
    run id, so its own keys); the group runs in one xdist worker, so it starts once a run. A
    test that stops, restarts or kills etcd starts its own."""
    from tests.procs import FIXTURE_PIDS
    from trainguard.testing.etcd import Etcd

    e = Etcd(tmp_path_factory.mktemp("etcd"), no_fsync=True)
    e.on_start = FIXTURE_PIDS.add  # its restarts are the fixture's, not a test's leftovers
    try:
        yield e
    finally:
        e.kill()


@pytest.fixture(autouse=True)
def _close_etcd_clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """etcd v3 clients a test made in this process are closed after it: their lease keep-alive
    threads would otherwise outlive the test (and its etcd), retrying for the rest of the run."""
    mod = sys.modules.get("trainguard.runtime.etcd_v3.client")
    if mod is None:
        yield
        return
    made = []
    init = mod.EtcdV3Client.__init__

    def tracked(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(mod.EtcdV3Client, "__init__", tracked)
    yield
    for client in made:
        try:
            client.close()
        except Exception:  # a half-built client has nothing to close
            pass


@pytest.fixture(autouse=True)
def _grad_mode_is_left_as_found() -> Iterator[None]:
    """A test (or the product code it runs in this process) that turns autograd off for the
    thread fails here, not in whichever test this worker runs next."""
    torch = sys.modules.get("torch")
    before = torch.is_grad_enabled() if torch is not None else True
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.is_grad_enabled() != before:
        torch.set_grad_enabled(before)
        pytest.fail(
            f"autograd left {'off' if before else 'on'}: grad mode is per thread, set it in a context"
        )


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _CPU_START[item.nodeid] = (_cpu_seconds(), time.monotonic(), time.time())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _BEFORE_CALL[item.nodeid] = set(descendants(os.getpid()))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    # The teardown report carries the leftovers, so that under pytest-xdist (``-n``) they reach
    # the controller's summary too (user_properties travel with the report).
    outcome = yield
    if call.when != "teardown":
        return
    reap()
    before = _BEFORE_CALL.pop(item.nodeid, None)
    if before is None:
        return
    new = [p for p in descendants(os.getpid()) if p not in before and p not in FIXTURE_PIDS]
    # a process SIGKILLed at the test's end may still be tearing itself down (its memory
    # released, not yet a zombie): a moment to finish dying before it counts as left running
    deadline = time.monotonic() + 2.0
    while new and time.monotonic() < deadline:
        time.sleep(0.05)
        reap()
        new = [p for p in new if alive(p)]
    left = [f"PID {pid} still running: {_cmdline(pid)}" for pid in new]
    if left:
        outcome.get_result().user_properties.append(("tg_left_processes", left))
    start = _CPU_START.pop(item.nodeid, None)
    if start is not None:
        cpu, wall = _cpu_seconds() - start[0], time.monotonic() - start[1]
        outcome.get_result().user_properties.append(("tg_cpu", [cpu, wall, start[2]]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # a failure is named the moment it happens (the -q progress line only prints "F", and a run
    # stopped or hung before its summary would never say which test it was)
    out = os.environ.get("TG_FAILURES_LOG")
    if out and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:  # the controller's
        with open(out, "a", encoding="utf-8") as log:
            log.write(f"{time.strftime('%H:%M:%S')} {report.when} {report.nodeid}\n")
    for key, value in report.user_properties:
        if key == "tg_left_processes":
            _LEFT.extend(f"{report.nodeid}: {line}" for line in value)
        elif key == "tg_cpu":
            gateway = getattr(getattr(report, "node", None), "gateway", None)  # xdist's worker
            worker = getattr(gateway, "id", "main")
            _CPU.append((float(value[0]), float(value[1]), report.nodeid, float(value[2]), worker))


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
    if _CPU:
        top = int(os.environ.get("TG_PROFILE_TOP", "15"))
        total = sum(row[0] for row in _CPU)
        terminalreporter.section(
            f"heaviest tests by CPU (pytest + reaped children; all {len(_CPU)}: {total:.0f} CPU s)"
        )
        terminalreporter.line(f"{'CPU s':>8} {'wall s':>8} {'share':>6}  test")
        for cpu, wall, nodeid, *_ in sorted(_CPU, reverse=True)[:top]:
            share = cpu / total if total else 0.0
            terminalreporter.line(f"{cpu:8.1f} {wall:8.1f} {share:6.1%}  {nodeid}")
        by_file: dict[str, list[float]] = {}
        for cpu, wall, nodeid, *_ in _CPU:
            entry = by_file.setdefault(nodeid.split("::")[0], [0.0, 0.0, 0.0])
            entry[0] += cpu
            entry[1] += wall
            entry[2] += 1
        terminalreporter.section("heaviest test files by CPU")
        terminalreporter.line(f"{'CPU s':>8} {'wall s':>8} {'share':>6} {'tests':>5}  file")
        ranked = sorted(by_file.items(), key=lambda kv: kv[1][0], reverse=True)
        for path, (cpu, wall, count) in ranked[:top]:
            share = cpu / total if total else 0.0
            terminalreporter.line(f"{cpu:8.1f} {wall:8.1f} {share:6.1%} {count:5.0f}  {path}")
        out = os.environ.get("TG_PROFILE_JSON")
        if out:  # the whole profile, for comparing two runs
            # each test's start (epoch seconds) and xdist worker: where the run's time went
            rows = [{"test": n, "cpu_s": round(c, 2), "wall_s": round(w, 2),
                     "start": round(t, 2), "worker": worker}
                    for c, w, n, t, worker in _CPU]  # fmt: skip
            Path(out).write_text(json.dumps(sorted(rows, key=lambda r: -r["cpu_s"]), indent=1))
            terminalreporter.line(f"whole profile: {out}")
    if _LEFT:
        terminalreporter.section("processes a test started and left running")
        for line in _LEFT:
            terminalreporter.line(line)
