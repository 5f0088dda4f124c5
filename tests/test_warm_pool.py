"""The warm pool on its own, real processes: a worker handed to a pre-started process behaves
exactly as the same command started cold (script and ``-m`` forms; exit codes, SystemExit
messages, uncaught exceptions, signals, stdout/stderr files, env, argv, cwd, ``__main__``);
the agent's one pool (its plugin) serves a spare's first start and the restarts after it.

The zygotes here preload nothing (``preload=()``) to stay cheap; the torch preload is
exercised by tests/test_run_warm.py through the agent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.launch_utils import REPO, WORKERS, base_env
from tests.procs import alive
from trainguard.core.config import TrainGuardConfig
from trainguard.core.config.warm import WarmConfig
from trainguard.core.events import EventLog
from trainguard.core.plugin import AgentContext
from trainguard.runtime.warm import HOOK_DIR, WarmPlugin, WarmPool, env_compatible, warm_argv_ok

PLAN_WORKER = str(WORKERS / "restart_plan.py")
FORMS = {
    "script": [sys.executable, "-u", PLAN_WORKER, "--opt", "a b", "${x}"],
    "module": [sys.executable, "-u", "-m", "tests.workers.restart_plan", "--opt", "a b"],
}
ACTIONS = ["ok", "exit7", "exitmsg", "raise", "sleep"]
_STARTED: list = []


@pytest.fixture(autouse=True)
def _kill_started() -> Iterator[None]:
    yield
    while _STARTED:
        p = _STARTED.pop()
        p.kill()
        p.wait()


def _wait_ready(pool: WarmPool, keys: set, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not keys <= set(pool.ready()):
        assert time.monotonic() < deadline, f"zygotes not ready: {keys - set(pool.ready())}"
        pool.tick()
        time.sleep(0.02)


def _start(pool: WarmPool, key: tuple, restart: int, tmp: Path, env: dict[str, str]):
    form, action = key
    out = open(tmp / f"{form}-{action}-{restart}.out", "w")  # noqa: SIM115
    err = open(tmp / f"{form}-{action}-{restart}.err", "w")  # noqa: SIM115
    env = dict(env, TORCHELASTIC_RESTART_COUNT=str(restart), PLAN=f"0:{action},1:{action}")
    env["DUMP_DIR"] = str(tmp / f"dump-{form}-{action}")
    proc = pool.spawn(FORMS[form], env, stdout=out, stderr=err, key=key)
    out.close()
    err.close()
    _STARTED.append(proc)
    return proc


def _finish(proc, dump: Path, sleeper: bool, timeout: float = 60.0) -> int:
    """Wait for the worker; a sleeper is SIGTERMed once it has written its dump."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < deadline, "worker did not finish"
        if sleeper and dump.exists():
            proc.kill(signal.SIGTERM)
        time.sleep(0.02)
    return proc.returncode


def test_warm_worker_is_indistinguishable_from_cold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = WarmPool(preload=(), prestart_delay_s=0)
    env = base_env(PLAN_RANK="0", RANK="0", TORCH="0")
    # the user's own sitecustomize still runs, after the hand-off (it sees the worker's env)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nos.environ['USER_SITE_SAW'] = os.environ['TORCHELASTIC_RESTART_COUNT']\n"
    )
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    (tmp_path / "cold").mkdir()
    (tmp_path / "warm").mkdir()
    monkeypatch.chdir(tmp_path / "cold")
    keys = [(f, a) for f in FORMS for a in ACTIONS]
    try:
        cold = {k: _start(pool, k, 0, tmp_path, env) for k in keys}
        codes_cold = {
            k: _finish(p, tmp_path / f"dump-{k[0]}-{k[1]}" / "env_0_0.json", k[1] == "sleep")
            for k, p in cold.items()
        }
        assert not any(p.warm for p in cold.values())
        _wait_ready(pool, set(keys))
        zygote_pids = pool.ready()
        monkeypatch.chdir(tmp_path / "warm")  # the hand-off carries the working directory
        warm = {k: _start(pool, k, 1, tmp_path, env) for k in keys}
        assert all(p.warm for p in warm.values())
        assert {k: p.pid for k, p in warm.items()} == zygote_pids  # the zygote is the worker
        codes_warm = {
            k: _finish(p, tmp_path / f"dump-{k[0]}-{k[1]}" / "env_1_0.json", k[1] == "sleep")
            for k, p in warm.items()
        }
    finally:
        pool.close()
    assert codes_warm == codes_cold
    for form in FORMS:
        expect = {"ok": 0, "exit7": 7, "exitmsg": 1, "raise": 1, "sleep": -signal.SIGTERM}
        assert {a: codes_cold[(form, a)] for a in ACTIONS} == expect
    for form, action in keys:
        stem = tmp_path / f"{form}-{action}"
        for ext in ("out", "err"):
            cold_text = Path(f"{stem}-0.{ext}").read_text()
            warm_text = Path(f"{stem}-1.{ext}").read_text()
            assert warm_text == cold_text.replace("restart 0", "restart 1"), (form, action, ext)
        d = tmp_path / f"dump-{form}-{action}"
        a = json.loads((d / "env_0_0.json").read_text())
        b = json.loads((d / "env_1_0.json").read_text())
        a["env"].pop("TORCHELASTIC_RESTART_COUNT")
        b["env"].pop("TORCHELASTIC_RESTART_COUNT")
        assert (a["env"].pop("USER_SITE_SAW"), b["env"].pop("USER_SITE_SAW")) == ("0", "1")
        assert b.pop("pid") == warm[(form, action)].pid != a.pop("pid")
        dirs = (str(tmp_path / "cold"), str(tmp_path / "warm"))
        assert (a.pop("cwd"), b.pop("cwd")) == dirs
        if form == "module":  # python -m puts the working directory first on sys.path
            assert (a.pop("path0"), b.pop("path0")) == dirs
        assert a == b, (form, action)  # env, argv, orig_argv, cwd, __name__, sys.path...
        assert b["name"] == "__main__" and b["path"] == []
        assert not any(k.startswith("TRAINGUARD_ZYGOTE") for k in b["env"])
    script = json.loads((tmp_path / "dump-script-ok" / "env_1_0.json").read_text())
    assert script["argv"] == [PLAN_WORKER, "--opt", "a b", "${x}"]
    assert script["path0"] == str(WORKERS)
    module = json.loads((tmp_path / "dump-module-ok" / "env_1_0.json").read_text())
    assert module["argv"][0] == PLAN_WORKER


def test_cold_when_the_process_cannot_be_reused(tmp_path: Path) -> None:
    pool = WarmPool(preload=(), prestart_delay_s=0)
    env = base_env(DUMP_DIR=str(tmp_path / "d"), TORCH="0")
    argv = FORMS["script"]
    try:
        first = pool.spawn(argv, env, key="a")
        _STARTED.append(first)
        assert not first.warm
        _wait_ready(pool, {"a"})
        zygote = pool.ready()["a"]
        # a start-up variable differs: the zygote is discarded (by PID) and the worker is cold
        p = pool.spawn(argv, dict(env, PYTHONHASHSEED="7"), key="a")
        _STARTED.append(p)
        assert not p.warm and p.pid != zygote
        assert p.wait(60) == 0 and not alive(zygote)
        _wait_ready(pool, {"a"})
        zygote = pool.ready()["a"]
        pool.close()
        assert not alive(zygote)
        # after close: cold, and no zygote is started again
        last = pool.spawn(argv, env, key="a")
        _STARTED.append(last)
        assert not last.warm
        pool.tick()
        assert pool.ready() == {}
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("argv", "ok"),
    [
        ([sys.executable, "-u", PLAN_WORKER], True),
        ([sys.executable, "-u", "-m", "tests.workers.restart_plan"], True),
        (["/bin/echo", "hi"], False),  # --no-python
        ([sys.executable, PLAN_WORKER], False),  # not torchrun's form
        ([sys.executable, "-u", "-S", PLAN_WORKER], False),  # the hook would not load
        ([sys.executable, "-u", str(REPO)], False),  # a directory as script
        ([sys.executable, "-u", "-c", "pass"], False),
    ],
)
def test_warm_argv_forms(argv: list[str], ok: bool) -> None:
    assert warm_argv_ok(argv) is ok


def test_env_compatible_allows_only_values_read_after_startup() -> None:
    base = {"PATH": "/bin", "RANK": "0", "OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "a"}
    dyn = dict(base, RANK="3", MASTER_PORT="1234", TORCHELASTIC_RUN_ID="b", TRAINGUARD_AGENT_X="1")
    assert env_compatible(base, dyn) == []
    assert env_compatible(base, dict(base, OMP_NUM_THREADS="4", PYTHONPATH="x")) == [
        "OMP_NUM_THREADS",
        "PYTHONPATH",
    ]
    assert env_compatible(base, {k: v for k, v in base.items() if k != "PATH"}) == ["PATH"]
    assert env_compatible(base, dict(base, TRAINGUARD_ZYGOTE_PRELOAD="x")) == [
        "TRAINGUARD_ZYGOTE_PRELOAD"
    ]
    # the agent's worker start-up hook on PYTHONPATH (the zygote has it first anyway)
    hooked = os.pathsep.join([HOOK_DIR, "/a"])
    assert env_compatible(dict(base, PYTHONPATH="/a"), dict(base, PYTHONPATH=hooked)) == []
    assert env_compatible(base, dict(base, PYTHONPATH=HOOK_DIR)) == []
    assert env_compatible(dict(base, PYTHONPATH="/a"), dict(base, PYTHONPATH=HOOK_DIR)) == [
        "PYTHONPATH"
    ]


def test_one_pool_serves_a_spares_first_start_and_the_restarts_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's warm plugin: a node that waits as a spare (``spare_waiting``) starts a
    zygote per local rank from the worker command line at once; torch's own process context
    then starts the spare's workers from them, and the restart after that from the zygotes
    the pool started for it. Each worker's process is the zygote ``warm_ready`` announced."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    for k, v in base_env(TORCH="0", PLAN="0:ok,1:ok", DUMP_DIR=str(tmp_path / "d")).items():
        monkeypatch.setenv(k, v)  # the agent's environment, which its workers inherit
    run_dir = tmp_path / "run"
    ctx = AgentContext(
        config=TrainGuardConfig(warm=WarmConfig(preload=[], prestart_delay_s=0)),
        run_dir=run_dir,
        events=EventLog(run_dir),
        launch_config=SimpleNamespace(nproc_per_node=2, max_nodes=3, max_restarts=0),
        worker_argv=(sys.executable, "-u", PLAN_WORKER, "--opt", "${local_rank}"),
    )
    ready: list[dict] = []
    ctx.events.subscribe(ready.append, ["warm_ready"])
    plugin = WarmPlugin(ctx)
    pool = ctx.warm_pool
    assert pool is plugin.pool

    def wait_ready(n: int) -> dict[int, int]:
        deadline = time.monotonic() + 60
        while len(ready) < n:
            assert time.monotonic() < deadline, f"warm processes not ready: {ready}"
            time.sleep(0.05)
        return {e["local_rank"]: e["pid"] for e in ready[n - 2 : n]}

    def start(restart: int) -> tuple[dict[int, bool], dict[int, int]]:
        with pool.serving_torch_workers() as started:
            pc = start_processes(
                name="trainer",
                entrypoint=sys.executable,
                args={lr: ("-u", PLAN_WORKER, "--opt", str(lr)) for lr in (0, 1)},
                envs={
                    lr: {
                        "RANK": str(lr),
                        "LOCAL_RANK": str(lr),
                        "TORCHELASTIC_RESTART_COUNT": str(restart),
                    }
                    for lr in (0, 1)
                },  # fmt: skip
                logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / f"logs{restart}")),
            )
        try:
            pids = pc.pids()
            result = pc.wait(timeout=60)
            assert result is not None and not result.is_failed(), result
        finally:
            pc.close()
        return started, pids

    try:
        # emitted while the agent waits in a round, with the rendezvous wrapper's variable set
        monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        ctx.events.emit("spare_waiting", round=3, reason="redundancy_list")
        spare_zygotes = wait_ready(2)
        monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
        started, pids = start(0)  # the spare takes a dead node's slot
        assert started == {0: True, 1: True}
        assert pids == spare_zygotes
        restart_zygotes = wait_ready(4)  # refilled for the restart
        assert set(restart_zygotes.values()).isdisjoint(spare_zygotes.values())
        started, pids = start(1)
        assert started == {0: True, 1: True}
        assert pids == restart_zygotes
        for restart, zygotes in enumerate((spare_zygotes, restart_zygotes)):
            for rank in (0, 1):
                dump = json.loads((tmp_path / "d" / f"env_{restart}_{rank}.json").read_text())
                assert dump["pid"] == zygotes[rank], (restart, rank)
                assert dump["argv"] == [PLAN_WORKER, "--opt", str(rank)]
        idle = wait_ready(6)
    finally:
        plugin.close()
    assert ctx.warm_pool is None and not any(alive(pid) for pid in idle.values())


# A read is a get or [] by key; walking every item (tqdm scans os.environ for its TQDM_*
# prefix at import) reads each value through Mapping's item view, which is not counted.
_SPY = """
import os, sys
reads = set()
get, getitem = os._Environ.get, os._Environ.__getitem__
def scanned():
    return "_collections_abc" in sys._getframe(2).f_code.co_filename
os._Environ.get = lambda self, k, d=None: (reads.add(k), get(self, k, d))[1]
os._Environ.__getitem__ = lambda self, k: (scanned() or reads.add(k), getitem(self, k))[1]
for name in sys.argv[1:]:
    __import__(name)
print(" ".join(sorted(reads)))
"""


def test_preload_reads_no_variable_a_zygote_may_differ_in() -> None:
    """The allowed differences hold for the default preload: importing it reads none of them
    from os.environ (C-level getenv at library load is not seen here)."""
    preload = WarmConfig().preload
    r = subprocess.run(
        [sys.executable, "-c", _SPY, *preload],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    reads = set(r.stdout.split())
    assert "TORCH_LOGS" in reads  # the spy sees torch's import-time reads
    assert not {k for k in reads if not env_compatible({}, {k: "x"})}
